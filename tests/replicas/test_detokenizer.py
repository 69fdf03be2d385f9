"""Incremental detokenization: text only grows, every value is a prefix of the final text, and
the final text equals a full decode."""

import pytest
from transformers import AutoTokenizer

from models import resolve_checkpoint
from replicas.detokenizer import IncrementalDetokenizer, token_bytes_of


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(resolve_checkpoint())


def decode_fn(tok):
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module", params=["decode", "byte-level"])
def make(request, tok):
    """Both ways: the tokenizer's decode with context (any tokenizer), and the byte-level one."""
    if request.param == "decode":
        return lambda: IncrementalDetokenizer(decode_fn(tok))
    table = token_bytes_of(tok)
    assert table is not None   # the embedded model's vocabulary is byte-level BPE

    def never(ids):
        raise AssertionError("the byte-level detokenizer called decode")
    return lambda: IncrementalDetokenizer(never, table)


@pytest.mark.parametrize("text", ["café ☃ 東京", "plain ascii {\"a\": 1}", "🙂🙂 x é", "ü"])
def test_split_characters_are_held_back_never_streamed_as_replacement(tok, make, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    naive = [tok.decode(ids[:i], skip_special_tokens=True) for i in range(1, len(ids) + 1)]
    # Decoding the whole output each step (the old way) shows U+FFFD for split characters.
    assert any(t.endswith("\ufffd") for t in naive) == (not text.isascii())
    d = make()
    seen = []
    for t in ids:
        d.add(t)
        assert "\ufffd" not in d.text
        seen.append(d.text)
    assert all(a == b[:len(a)] for a, b in zip(seen, seen[1:]))   # only ever grows
    assert d.text == text and d.flush() == text


def test_random_ids_with_special_tokens_match_full_decode(tok, make):
    import random
    rng = random.Random(0)
    special = sorted(tok.all_special_ids)
    for _ in range(200):
        ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        d = make()
        prev = ""
        for t in ids:
            d.add(t)
            assert d.text.startswith(prev)
            prev = d.text
        full = tok.decode(ids, skip_special_tokens=True)
        assert full.startswith(d.text)        # held back: at most an incomplete last character
        assert d.flush() == full


def test_cut_off_character_appears_at_flush(tok, make):
    ids = tok("é", add_special_tokens=False)["input_ids"]
    d = make()
    d.add(ids[0])
    assert d.text == "" and d.flush() == "\ufffd"


def test_byte_level_table_equals_decode_for_every_id(tok):
    """Each id's bytes, decoded alone, are what the tokenizer decodes it to (special tokens and
    ids past the vocabulary: nothing; added tokens such as <tool_call>: their text)."""
    table = token_bytes_of(tok)
    for i in range(len(tok) + 3):
        assert table[i].decode("utf-8", "replace") == tok.decode([i], skip_special_tokens=True), i


def test_byte_level_on_qwen3_vocabulary():
    """The same on Qwen3's 151K vocabulary (byte-level BPE with 26 added tokens): random ids,
    special and added tokens among them, give the full decode; split characters wait."""
    import random
    vocab = pytest.importorskip("models.vocab")
    try:
        qwen = AutoTokenizer.from_pretrained(vocab.tokenizer_dir("qwen3"))
    except Exception as e:   # the vocabulary package is an optional extra
        pytest.skip(f"no Qwen3 tokenizer here: {e}")
    table = token_bytes_of(qwen)
    assert table is not None
    rng, added = random.Random(1), list(range(151643, 151669))
    for _ in range(300):
        ids = [rng.choice(added) if rng.random() < 0.1 else rng.randrange(151643) for _ in range(rng.randrange(1, 30))]
        d = IncrementalDetokenizer(None, table)
        for t in ids:
            d.add(t)
        full = qwen.decode(ids, skip_special_tokens=True)
        assert full.startswith(d.text) and d.flush() == full
    ids = qwen("café 東京 🙂", add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(None, table)
    for t in ids:
        assert "\ufffd" not in d.add(t)
    assert d.text == "café 東京 🙂"
