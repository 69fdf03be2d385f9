"""Incremental detokenization: text only grows, every value is a prefix of the final text, and
the final text equals a full decode."""

import pytest
from transformers import AutoTokenizer

from models import resolve_checkpoint
from replicas.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(resolve_checkpoint())


def decode_fn(tok):
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", ["café ☃ 東京", "plain ascii {\"a\": 1}", "🙂🙂 x é", "ü"])
def test_split_characters_are_held_back_never_streamed_as_replacement(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    naive = [tok.decode(ids[:i], skip_special_tokens=True) for i in range(1, len(ids) + 1)]
    # Decoding the whole output each step (the old way) shows U+FFFD for split characters.
    assert any(t.endswith("\ufffd") for t in naive) == (not text.isascii())
    d = IncrementalDetokenizer(decode_fn(tok))
    seen = []
    for t in ids:
        d.add(t)
        assert "\ufffd" not in d.text
        seen.append(d.text)
    assert all(a == b[:len(a)] for a, b in zip(seen, seen[1:]))   # only ever grows
    assert d.text == text and d.flush() == text


def test_random_ids_with_special_tokens_match_full_decode(tok):
    import random
    rng = random.Random(0)
    special = sorted(tok.all_special_ids)
    for _ in range(200):
        ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        d = IncrementalDetokenizer(decode_fn(tok))
        prev = ""
        for t in ids:
            d.add(t)
            assert d.text.startswith(prev)
            prev = d.text
        full = tok.decode(ids, skip_special_tokens=True)
        assert full.startswith(d.text)        # held back: at most an incomplete last character
        assert d.flush() == full


def test_cut_off_character_appears_at_flush(tok):
    ids = tok("é", add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(decode_fn(tok))
    d.add(ids[0])
    assert d.text == "" and d.flush() == "\ufffd"
