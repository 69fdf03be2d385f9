"""``uniqueItems`` over arrays of free strings, checked while decoding (replicas/unique_items.py):
where the arrays are found, instances through the whole path (schema in, the server's matcher,
text token by token, then EOS), the step's bitmask, rollback, and the compiler process."""

import json
import random

import jsonschema
import pytest

from replicas.grammar import GrammarCompiler, GrammarSpec
from replicas.unique_items import ANY_KEY, ITEM, UniqueStringsMatcher, unique_string_paths

STR = {"type": "string"}
TAGS = {"type": "array", "items": STR, "uniqueItems": True}


@pytest.mark.parametrize("schema,paths", [
    ({"type": "object", "properties": {"tags": TAGS}}, {("tags",)}),
    (TAGS, {()}),
    ({"type": "array", "items": {"type": "object", "properties": {"t": TAGS}}}, {(ITEM, "t")}),
    ({"type": "object", "additionalProperties": TAGS}, {(ANY_KEY,)}),
    ({"$defs": {"t": TAGS}, "type": "object", "properties": {"a": {"$ref": "#/$defs/t"}},
      "anyOf": [{"properties": {"b": {"$ref": "#/$defs/t"}}}]}, {("a",), ("b",)}),
    ({"type": "object", "properties": {"n": {"type": "integer"}}}, set()),
    ({"type": "array", "items": {"type": "string", "minLength": 2, "description": "d"}, "uniqueItems": True}, {()}),
])
def test_paths_of_unique_arrays(schema, paths):
    assert unique_string_paths(schema) == frozenset((p, None) for p in paths)


def test_enum_items_carry_their_values():
    schema = {"type": "object", "properties": {"l": {"type": "array", "uniqueItems": True,
                                                     "items": {"type": "string", "enum": ["a", "b", "c", "d", "e", "f"]}}}}
    assert unique_string_paths(schema) == frozenset({(("l",), frozenset("abcdef"))})
    clash = {"type": "object", "properties": {"l": {"type": "array", "items": STR, "uniqueItems": True}},
             "anyOf": [{"properties": {"l": {"type": "array", "items": {"enum": ["a"]}, "uniqueItems": True}}}]}
    assert unique_string_paths(clash) is None   # one place, two kinds of items


@pytest.mark.parametrize("schema", [
    {"type": "array", "items": {"type": "string", "maxLength": 3}, "uniqueItems": True},   # bounded: may dead-end
    {"type": "array", "items": {"type": "string", "enum": ["a", "b\"", "c"]}, "uniqueItems": True},   # escaped: two spellings
    {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    {"type": "array", "uniqueItems": True},
    {"$defs": {"n": {"type": "object", "properties": {"k": {"$ref": "#/$defs/n"}, "t": TAGS}}}, "$ref": "#/$defs/n"},
    {"type": "object", "properties": {"t": {"$ref": "https://example.com/s.json"}, "u": TAGS}},
])
def test_what_it_cannot_check_is_left(schema):
    assert unique_string_paths(schema) is None


def _validator(schema):
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


@pytest.mark.parametrize("schema,valid,invalid", [
    ({"type": "object", "properties": {"tags": TAGS}, "required": ["tags"]},
     [{"tags": ["a", "b"]}, {"tags": []}, {"tags": ["a", "ab", "b a"]}, {"tags": ["x\n", "x"]}],
     [{"tags": ["a", "a"]}, {"tags": ["x", "y", "x"]}, {"tags": ["", ""]}]),
    ({"type": "array", "items": {"type": "object", "properties": {"t": TAGS}}},
     [[{"t": ["a"]}, {"t": ["a"]}]],                            # unique within each array only
     [[{"t": ["a"]}, {"t": ["b", "b"]}]]),
])
def test_unique_strings_served_exactly(engine, schema, valid, invalid):
    from bench.grammar_soundness import Grammar
    v = _validator(schema)
    assert all(v.is_valid(x) for x in valid) and not any(v.is_valid(x) for x in invalid)
    g = Grammar(engine.grammar, engine.tokenizer, schema)
    assert g.backend == "llguidance" and isinstance(g.new(), UniqueStringsMatcher)
    for x in valid:
        assert g.guided(x) is not None, x
    for x in invalid:
        assert g.guided(x) is None, x
    rng = random.Random(0)
    for _ in range(20):   # the mask never lets a repeated item through
        text = g.sample(rng)
        assert text is None or v.is_valid(json.loads(text)), text


ENUM6 = {"type": "array", "uniqueItems": True, "items": {"type": "string", "enum": ["a", "ab", "b", "c", "d", "e"]}}


@pytest.mark.parametrize("schema,valid,invalid", [
    ({"type": "object", "properties": {"l": ENUM6}, "required": ["l"]},
     [{"l": ["a", "ab"]}, {"l": ["ab", "a", "b", "c", "d", "e"]}, {"l": []}],
     [{"l": ["a", "a"]}, {"l": ["ab", "c", "ab"]}, {"l": ["x"]}]),
    ({**ENUM6, "minItems": 6}, [["e", "d", "c", "b", "ab", "a"]], [["a", "b", "c", "d", "e"], ["a"] * 6]),
])
def test_unique_enum_strings_served_exactly(engine, schema, valid, invalid):
    test_unique_strings_served_exactly(engine, schema, valid, invalid)


def test_enum_array_looks_ahead(engine):
    """Every value but "ab" used: after '"a' only 'b"' is left, a comma after the last value is
    refused, and every token the mask leaves is one the matcher takes (no dead end)."""
    import torch
    m = engine.grammar.matcher(GrammarSpec("json_schema", ENUM6))
    assert m.accept_string('["a", "b", "c", "d", "e", "a') and not m.accept_string('"') and m.accept_string('b"')
    assert not m.accept_string(", ")   # no value left for another item
    m2 = engine.grammar.matcher(GrammarSpec("json_schema", ENUM6))
    assert m2.accept_string('["ab", "b", "c", "d", "e", ')
    logits = torch.zeros(1, engine.grammar.vocab_size)
    engine.grammar.apply_bitmask(logits, [m2])
    allowed = [t for t in range(engine.grammar.vocab_size) if logits[0, t] > float("-inf")]
    assert allowed
    for t in allowed:
        assert m2.accept_token(t), engine.tokenizer.decode([t])
        m2.rollback(1)
    assert m2.accept_string('"a"]')


def _ids(engine, text):
    return engine.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_escaped_repeat_is_refused_and_rollback_restores(engine):
    m = engine.grammar.matcher(GrammarSpec("json_schema", {"type": "object", "properties": {"tags": TAGS}}))
    assert isinstance(m, UniqueStringsMatcher)
    head = _ids(engine, '{"tags": ["a", ')
    assert all(m.accept_token(t) for t in head)
    assert not m.accept_string('"\\u0061"')             # "a" again, written with an escape
    assert m.accept_string('"b"')
    m.rollback(len(_ids(engine, '"b"')))
    assert not m.accept_string('"a"') and m.accept_string('"b"')
    assert m.accept_string("]}") and m.accept_token(engine.grammar.info.stop_token_ids[0])


def test_bitmask_masks_only_tokens_closing_a_repeat(engine):
    import torch
    spec = GrammarSpec("json_schema", {"type": "object", "properties": {"tags": TAGS}})
    m = engine.grammar.matcher(spec)
    for t in _ids(engine, '{"tags": ["ab", "ab'):
        assert m.accept_token(t)
    vocab = engine.grammar.vocab_size
    logits = torch.zeros(1, vocab)
    engine.grammar.apply_bitmask(logits, [m])
    allowed = [t for t in range(vocab) if logits[0, t] > float("-inf")]
    tok = engine.tokenizer
    closing = [t for t in range(vocab) if tok.decode([t]).startswith('"')]   # 'ab' again
    assert closing and not any(t in allowed for t in closing)
    assert any(tok.decode([t]).startswith("c") for t in allowed)   # the string may go on
    for t in allowed[:200]:   # every token left is one the matcher takes
        if t in engine.grammar.info.stop_token_ids:
            continue
        assert m.accept_token(t), tok.decode([t])
        m.rollback(1)


def test_paths_cross_the_compiler_process(engine):
    compiler = GrammarCompiler(engine.tokenizer, engine.grammar.vocab_size, isolate=True)
    try:
        m = compiler.matcher(GrammarSpec("json_schema", TAGS))
        assert isinstance(m, UniqueStringsMatcher)
        assert m.accept_string('["x", ') and not m.accept_string('"x"')
    finally:
        compiler.close()


def test_engine_output_has_no_repeated_item(engine, chat_prompts):
    """Generation through the engine (sampled, a batch of 8) with a schema whose array of strings
    must be unique: every finished output parses and validates."""
    from replicas.sampling_params import SamplingParams
    schema = {"type": "object", "properties": {"tags": {**TAGS, "minItems": 3}}, "required": ["tags"],
              "additionalProperties": False}
    spec = GrammarSpec("json_schema", schema)
    prompts = (chat_prompts * 8)[:8]
    outs = engine.generate(prompts, SamplingParams(max_tokens=160, temperature=1.0, seed=3), [spec] * 8)
    v = _validator(schema)
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert finished, [o.finish_reason for o in outs]
    for o in finished:
        assert v.is_valid(json.loads(o.text)), o.text


def test_engine_fills_an_enum_array_without_dead_end(engine, chat_prompts):
    """minItems equal to the enum's size: every output must use each value once, in some order,
    and each ends its JSON (the look-ahead leaves no sequence stuck)."""
    from replicas.sampling_params import SamplingParams
    schema = {"type": "object", "properties": {"l": {**ENUM6, "minItems": 6}}, "required": ["l"],
              "additionalProperties": False}
    outs = engine.generate((chat_prompts * 8)[:8], SamplingParams(max_tokens=120, temperature=1.0, seed=5),
                           [GrammarSpec("json_schema", schema)] * 8)
    v = _validator(schema)
    for o in outs:
        assert o.finish_reason == "stop", (o.finish_reason, o.text)
        assert v.is_valid(json.loads(o.text)) and sorted(json.loads(o.text)["l"]) == sorted(ENUM6["items"]["enum"])
