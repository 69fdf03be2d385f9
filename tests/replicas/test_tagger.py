"""PASK structural tagging of generated tokens (tool calls and bare JSON)."""

import json

import pytest

from models import chat
from replicas.tagger import BUCKETS, NUM_BUCKETS, Role, StructuralTagger, bucket_of

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"}, "hourly": {"type": "boolean"}}}}}]


def tag_pieces(tagger, pieces):
    return [BUCKETS[bucket_of(tagger.feed(p))] for p in pieces]


def chars(text):
    return list(text)  # one character per "token": the finest split


def test_tool_call_roles_per_character():
    text = "Ok <tool_call>\n" + json.dumps({"name": "get_weather", "arguments": {
        "city": "Paris", "unit": "celsius", "days": 3, "hourly": True}}) + "\n</tool_call>"
    t = StructuralTagger(TOOLS, near_k=0)
    pieces = ["O", "k", " ", "<tool_call>"] + chars(text[len("Ok <tool_call>"):-len("</tool_call>")]) + ["</tool_call>"]
    got = dict(zip(range(len(pieces)), tag_pieces(t, pieces)))
    joined = "".join(pieces)

    def bucket_at(substring, offset=0):
        start = joined.index(substring) + offset
        acc = 0
        for i, p in enumerate(pieces):
            if acc <= start < acc + len(p):
                return got[i]
            acc += len(p)
    assert bucket_at("O") == "free_text" and bucket_at("<tool_call>") == "call_boundary"
    assert bucket_at("name") == "field_key" and bucket_at("arguments") == "field_key"
    assert bucket_at("get_weather") == "function_name"
    assert bucket_at("city") == "arg_key_required" and bucket_at("days") == "arg_key_optional"
    assert bucket_at("Paris") == "string_required" and bucket_at("celsius") == "enum_value"
    assert bucket_at("3") == "number_optional" and bucket_at("true") == "literal"
    assert bucket_at("{") == "punctuation" and bucket_at("</tool_call>") == "call_boundary"


def test_multi_character_tokens_take_the_most_critical_role():
    t = StructuralTagger(TOOLS)
    got = tag_pieces(t, ["<tool_call>", "\n", '{"', "name", '": "get', "_weather", '", "', "arguments", '": {"',
                         "city", '": "', "Rome", '"}}\n', "</tool_call>"])
    assert got[4] == "function_name"           # '": "get' holds punctuation and the name
    assert got[6] == "punctuation_near_critical"  # right after the function name
    assert got[9] == "arg_key_required"


def test_escaped_quotes_stay_inside_strings():
    t = StructuralTagger(TOOLS, near_k=0)
    text = chat.render_answer([{"name": "get_weather", "arguments": {"city": 'a "b" c', "days": 1}}])
    got = tag_pieces(t, chars(text))
    inner = 'a \\"b\\" c'  # as JSON writes it
    start = text.index(inner)
    assert set(got[start:start + len(inner)]) == {"string_required"}
    assert got[text.index("days")] == "arg_key_optional"


def test_bare_json_schema_output():
    schema = {"type": "object", "required": ["ok"], "properties": {
        "ok": {"type": "boolean"}, "level": {"enum": ["low", "high"]}, "tags": {"type": "array", "items": {"type": "string"}}}}
    t = StructuralTagger(json_schema=schema, near_k=0)
    text = json.dumps({"ok": False, "level": "low", "tags": ["x", "y"]})
    got = tag_pieces(t, chars(text))
    assert got[text.index("ok")] == "arg_key_required" and got[text.index("false")] == "literal"
    assert got[text.index("low")] == "enum_value" and got[text.index("x")] == "string_optional"


@pytest.mark.parametrize("text", ["plain answer, no call", "<tool_call>\n{\"name\": \"unknown_fn\", \"arguments\": {\"a\": [1, {\"b\": null}]}}\n</tool_call>",
                                  "<tool_call>\n{\"name\": \"get_weather\", \"argu"])
def test_never_fails_on_any_text(text):
    t = StructuralTagger(TOOLS)
    tags = [t.feed(c) for c in text]
    assert all(0 <= bucket_of(tag) < NUM_BUCKETS for tag in tags)
    if text.startswith("plain"):
        assert {tag.role for tag in tags} <= {Role.FREE_TEXT, Role.WHITESPACE}


def test_real_tokens_with_characters_split_across_tokens():
    """Fed as the engine feeds it (each token of the real byte-level vocabulary decoded alone), a
    value whose characters span several tokens ("ü", "☃" decode as U+FFFD piece by piece) is
    tagged as the value throughout, and the tagger stays in step for the keys after it."""
    from transformers import AutoTokenizer
    from models import resolve_checkpoint
    tok = AutoTokenizer.from_pretrained(resolve_checkpoint())
    text = chat.render_answer([{"name": "get_weather", "arguments": {"city": "Zürich ☃", "days": 2}}])
    assert "Zürich ☃" in text  # written as UTF-8, not \\u escapes
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces = [tok.decode([i]) for i in ids]
    assert sum("\ufffd" in p for p in pieces) >= 2
    got = tag_pieces(StructuralTagger(TOOLS, near_k=0), pieces)
    # Each token's byte offset (byte-level BPE: one symbol of the token string per byte).
    raw = text.encode()
    sizes = [len(t) for t in tok.convert_ids_to_tokens(ids)]
    assert sum(sizes) == len(raw)
    spans = [sum(sizes[:k]) for k in range(len(ids))]
    start, end = raw.index("Zürich ☃".encode()), raw.index("Zürich ☃".encode()) + len("Zürich ☃".encode())
    inside = [g for s, g in zip(spans, got) if start <= s < end]
    assert inside and set(inside) == {"string_required"}, inside
    assert got[[p.strip('" ') for p in pieces].index("days")] == "arg_key_optional"


def test_whole_token_fast_path_equals_per_character_tagging():
    """Tokens tagged in one step (free text, a run inside a JSON string) get the tag and leave
    the state that tagging them character by character gives: the synthetic test split's answers
    (tool calls and JSON), split by the real tokenizer and at random points."""
    import random

    from transformers import AutoTokenizer

    from models import resolve_checkpoint, synth
    tok = AutoTokenizer.from_pretrained(resolve_checkpoint())
    rng = random.Random(0)

    class PerCharacter(StructuralTagger):
        _whole_tokens = False

    class Counting(StructuralTagger):   # tokens that went character by character
        slow = 0

        def _consume(self, text):
            Counting.slow += 1
            return super()._consume(text)
    cases = []
    for cat in ("simple", "multiple", "parallel", "irrelevance"):
        for ex in synth.Generator("test", seed=1).examples(cat, 6):
            text = "Sure, the answer:\n" + chat.render_answer(ex.answer) if ex.answer else "No tool fits \"that\"."
            ids = tok(text, add_special_tokens=False)["input_ids"]
            cases.append((ex.tools, None, [tok.decode([i]) for i in ids]))
            cut = sorted(rng.sample(range(1, len(text)), min(12, len(text) - 1)))
            cases.append((ex.tools, None, [text[a:b] for a, b in zip([0] + cut, cut + [len(text)])]))
    schema = {"type": "object", "required": ["title", "tags"], "properties": {
        "title": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}}}
    doc = json.dumps({"title": "a \"quoted\" title\\n", "tags": ["alpha beta", "gamma"], "extra": "x y"})
    cases.append((None, schema, [tok.decode([i]) for i in tok(doc, add_special_tokens=False)["input_ids"]]))
    tokens = 0
    for tools, js, pieces in cases:
        fast, slow = Counting(tools, json_schema=js), PerCharacter(tools, json_schema=js)
        for piece in pieces:
            tokens += 1
            assert fast.feed_bucket(piece) == bucket_of(slow.feed(piece)), (pieces, piece)
        assert fast._string_text == slow._string_text and fast._mode == slow._mode
    assert tokens - Counting.slow > 100   # the fast path did run
