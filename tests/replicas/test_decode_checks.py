"""Keywords checked on the text while decoding (replicas/decode_checks.py): ``uniqueItems`` and
``minProperties`` / ``maxProperties`` on open objects. Where the checks go, instances through the
whole path (schema in, the server's matcher, text token by token, then EOS), the step's bitmask
(nothing left without a way forward), rollback, and the compiler process."""

import json
import random

import jsonschema
import pytest

from replicas.grammar import GrammarCompiler, GrammarSpec
from replicas.decode_checks import ANY_KEY, ITEM, CheckedMatcher, check_paths

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
    assert check_paths(schema) == frozenset((p, ("items", None, False)) for p in paths)


def test_enum_items_carry_their_values():
    schema = {"type": "object", "properties": {"l": {"type": "array", "uniqueItems": True,
                                                     "items": {"type": "string", "enum": ["a", "b", "c", "d", "e", "f"]}}}}
    assert check_paths(schema) == frozenset({(("l",), ("items", frozenset("abcdef"), False))})
    clash = {"type": "object", "properties": {"l": {"type": "array", "items": STR, "uniqueItems": True}},
             "anyOf": [{"properties": {"l": {"type": "array", "items": {"enum": ["a"]}, "uniqueItems": True}}}]}
    assert check_paths(clash) is None   # one place, two kinds of items


@pytest.mark.parametrize("schema", [
    {"type": "array", "items": {"type": "string", "maxLength": 3}, "uniqueItems": True},   # bounded: may dead-end
    {"type": "array", "items": {"type": "string", "enum": ["a", "b\"", "c"]}, "uniqueItems": True},   # escaped: two spellings
    {"type": "array", "items": {"type": "integer", "maximum": 9}, "uniqueItems": True},
    {"type": "array", "items": {"type": "integer", "minimum": -3}, "uniqueItems": True},   # -3 cannot go on to -30
    {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{3}$"}, "uniqueItems": True},
    {"type": "array", "items": {"type": "string", "format": "date"}, "uniqueItems": True},
    {"type": "array", "items": {"type": "object", "properties": {"a": STR}, "additionalProperties": False},
     "uniqueItems": True},   # {"a": "x"} twice: nothing may follow "x"
    {"type": "array", "items": {"type": "object", "maxProperties": 2}, "uniqueItems": True},
    {"type": "array", "items": {"anyOf": [STR, {"type": "string", "maxLength": 2}]}, "uniqueItems": True},
    {"type": "array", "items": {"allOf": [{"pattern": "^a+$"}, {"pattern": "^[ab]*c$"}]}, "uniqueItems": True},
    {"$defs": {"n": {"type": "object", "properties": {"k": {"$ref": "#/$defs/n"}, "t": TAGS}}}, "$ref": "#/$defs/n"},
    {"type": "object", "properties": {"t": {"$ref": "https://example.com/s.json"}, "u": TAGS}},
])
def test_what_it_cannot_check_is_left(schema):
    assert check_paths(schema) is None


@pytest.mark.parametrize("items,integers_only", [
    ({"type": "integer"}, True),
    ({"type": "integer", "minimum": 0}, True),
    ({"type": "number"}, False),
    (None, False),                                        # any JSON value
    ({"type": ["string", "integer", "boolean"]}, True),
    ({"type": "object", "properties": {"a": STR}, "required": ["a"]}, False),
    ({"type": "string", "pattern": "^[a-z][a-z0-9-]*$", "format": "uri"}, False),
    ({"anyOf": [STR, {"type": "array", "items": {"type": "integer"}}]}, False),
])
def test_extendable_items_are_checked(items, integers_only):
    schema = {"type": "array", "uniqueItems": True, **({"items": items} if items is not None else {})}
    assert check_paths(schema) == frozenset({((), ("items", None, integers_only))})


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
    assert g.backend == "llguidance" and isinstance(g.new().inner, CheckedMatcher)   # (inside the name check)
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


OBJ = {"type": "object", "properties": {"a": STR, "n": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("schema,valid,invalid", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
     [[1, 2], [0, 1], [10, 1], [-1, 1], []], [[1, 1], [0, 0], [0, -0], [5, 3, 5]]),
    ({"type": "array", "items": {"type": "number"}, "uniqueItems": True},
     [[1, 1.5], [0, 0.5]], [[1, 1.0], [0.5, 0.50]]),
    ({"type": "array", "uniqueItems": True},                 # any items: compared as jsonschema does
     [[1, "1", True, None, [1], {"a": 1}], [True, False], [[1], [1, 2]], [1, True]],
     [[True, True], [None, None], [{"a": 1, "b": 2}, {"b": 2, "a": 1}], [[1], [1]], ["x", "x"], [1, 1.0]]),
    ({"type": "array", "items": OBJ, "uniqueItems": True},
     [[{"a": "x"}, {"a": "y"}], [{"a": "x"}, {"a": "x", "n": 1}], [{"a": "x"}, {"a": "x", "z": 0}]],
     [[{"a": "x"}, {"a": "x"}], [{"a": "x", "n": 2}, {"a": "y"}, {"a": "x", "n": 2}]]),
    ({"type": "object", "properties": {"l": {"type": "array", "uniqueItems": True,
                                             "items": {"type": "string", "pattern": "^[a-z]+$"}}}},
     [{"l": ["ab", "abc"]}], [{"l": ["ab", "ab"]}]),
])
def test_unique_extendable_items_served_exactly(engine, schema, valid, invalid):
    test_unique_strings_served_exactly(engine, schema, valid, invalid)


@pytest.mark.parametrize("schema,prefix,gone", [
    ({"type": "array", "items": OBJ, "uniqueItems": True}, '[{"a": "x"}, {"a": "x"', ["}", "}]", "},"]),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[5, 5", [",", "]", ", "]),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[0, ", ["0"]),     # 0 cannot go on
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[0, -", ["0"]),
    ({"type": "array", "uniqueItems": True}, "[true, null, ", ["t", "true", "n", "null"]),
])
def test_mask_ends_no_repeat_and_leaves_a_way_on(engine, schema, prefix, gone):
    """After a prefix whose open item equals an earlier one (or would), the tokens that would
    end it so are masked, something is left, and the matcher takes every token left."""
    import torch
    m = engine.grammar.matcher(GrammarSpec("json_schema", schema))
    assert m.accept_string(prefix)
    logits = torch.zeros(1, engine.grammar.vocab_size)
    engine.grammar.apply_bitmask(logits, [m])
    allowed = [t for t in range(engine.grammar.vocab_size) if logits[0, t] > float("-inf")]
    texts = [engine.tokenizer.decode([t]) for t in allowed]
    assert allowed and not set(gone) & set(texts), texts
    for t in allowed:
        if t not in engine.grammar.info.stop_token_ids:
            assert m.accept_token(t), engine.tokenizer.decode([t])
            m.rollback(1)


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
    assert isinstance(m.inner, CheckedMatcher)   # (inside the name check)
    head = _ids(engine, '{"tags": ["a", ')
    assert all(m.accept_token(t) for t in head)
    assert not m.accept_string('"\\u0061"')             # "a" again, written with an escape
    assert m.accept_string('"b"')
    m.rollback(len(_ids(engine, '"b"')))
    assert not m.accept_string('"a"') and m.accept_string('"b"')
    assert m.accept_string("]}") and m.accept_token(engine.grammar.info.stop_token_ids[0])


def test_rollback_past_many_tokens_restores_the_checks(engine):
    """Rollback rebuilds the scans from a snapshot kept every ``MARK_EVERY`` tokens: 300 random
    rollbacks (across snapshots too) and re-reads of a long text leave both checks (unique items,
    one name per object) exactly where a fresh matcher fed the same tokens is."""
    from replicas.decode_checks import MARK_EVERY
    spec = GrammarSpec("json_schema", {"type": "object", "properties": {"n": {"type": "integer"}, "tags": TAGS}})
    ids = _ids(engine, '{"n": 1, "tags": [' + ", ".join(f'"t{i}"' for i in range(60)))
    assert len(ids) > 4 * MARK_EVERY
    m, rng, pos = engine.grammar.matcher(spec), random.Random(0), 0
    for _ in range(300):
        step = rng.randint(0, min(pos, 3 * MARK_EVERY))
        m.rollback(step)
        pos -= step
        more = rng.randint(0, len(ids) - pos)
        assert all(m.accept_token(t) for t in ids[pos:pos + more])
        pos += more
        fresh = engine.grammar.matcher(spec)
        assert all(fresh.accept_token(t) for t in ids[:pos])
        assert (m._scan.stack, m._scan.in_str, m._scan.raw) == (fresh._scan.stack, fresh._scan.in_str, fresh._scan.raw)
        assert m.inner._scan.stack == fresh.inner._scan.stack
        if pos < len(ids) and rng.random() < 0.2:   # the next token: the same verdict as a fresh matcher's
            assert m._blocked(engine.grammar._bytes_of[0][ids[pos]]) == fresh._blocked(engine.grammar._bytes_of[0][ids[pos]])
    assert all(m.accept_token(t) for t in ids[pos:])
    assert not m.accept_string(', "t5"')   # a repeated item
    assert m.accept_string(', "t60"') and m.accept_string("]}")
    assert m.accept_token(engine.grammar.info.stop_token_ids[0])


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
        assert isinstance(m.inner, CheckedMatcher)   # (inside the name check)
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


OPEN = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 5}}}   # (to llguidance)


@pytest.mark.parametrize("schema,checks", [
    ({**OPEN, "minProperties": 1}, {((), ("properties", 1, None))}),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 2},
     {((), ("properties", 0, 2))}),
    ({"type": "object", "properties": {"m": {"type": "object", "patternProperties": {"^[a-z]+$": STR},
                                             "additionalProperties": False, "minProperties": 1}}},
     {(("m",), ("properties", 1, None))}),
    ({**OPEN, "additionalProperties": False, "required": ["a"], "minProperties": 1}, set()),   # llguidance's own
    ({**OPEN, "additionalProperties": False, "minProperties": 1},       # closed: followed name by name
     {((), ("properties", 1, None, (("a", False),)))}),
])
def test_counts_go_to_the_text_where_llguidance_cannot(schema, checks):
    assert check_paths(schema) == frozenset((p, c + (None,) * (4 - len(c))) for p, c in checks)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": STR}, "required": ["a"], "additionalProperties": True,
     "maxProperties": 1},                                    # the comma allowed may come before "a"
    {"anyOf": [{**OPEN, "minProperties": 1}, {"type": "object", "properties": {"b": STR},
                                              "additionalProperties": False}]},   # closed: no new name
    {"type": "object", "patternProperties": {"^[a-z]$": STR}, "additionalProperties": False,
     "minProperties": 1, "maxProperties": 3},                # finitely many names
])
def test_counts_that_could_dead_end_are_left(schema):
    assert check_paths(schema) is None


@pytest.mark.parametrize("schema,valid,invalid", [
    ({**OPEN, "minProperties": 1}, [{"a": "x"}, {"z": 1}, {"a": "x", "b": 2}], [{}]),
    ({**OPEN, "minProperties": 2}, [{"a": "x", "b": 2}, {"y": 1, "z": 1}], [{}, {"a": "x"}, {"z": None}]),
    ({"type": "object", "additionalProperties": {"type": "string", "maxLength": 3}, "maxProperties": 2},
     [{}, {"x": "1"}, {"x": "1", "y": "2"}], [{"x": "1", "y": "2", "z": "3"}]),
    ({"type": "object", "properties": {"links": {"type": "object", "patternProperties": {"^[a-z_]+$": {"type": "array"}},
                                                 "additionalProperties": False, "maxProperties": 1}}},
     [{"links": {}}, {"links": {"a": []}}], [{"links": {"a": [], "b": []}}]),
])
def test_counts_served_exactly(engine, schema, valid, invalid):
    test_unique_strings_served_exactly(engine, schema, valid, invalid)


@pytest.mark.parametrize("schema,prefix,gone", [
    ({**OPEN, "minProperties": 1}, "{", ["}", "{}"]),
    ({**OPEN, "minProperties": 2}, '{"a": "x"', ["}", '"}']),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 2}, '{"x": 1, "y": 2', [",", ", "]),
])
def test_counted_mask_leaves_a_way_on(engine, schema, prefix, gone):
    test_mask_ends_no_repeat_and_leaves_a_way_on(engine, schema, prefix, gone)


S3 = {"type": "string", "maxLength": 3}
ABC = {"type": "object", "properties": {"a": S3, "b": S3, "c": S3}, "additionalProperties": False}


@pytest.mark.parametrize("schema,valid,invalid", [
    ({**ABC, "minProperties": 2}, [{"a": "x", "b": "y"}, {"b": "x", "c": "y"}, {"a": "", "b": "", "c": ""}],
     [{}, {"a": "x"}, {"c": "x"}]),
    ({**ABC, "required": ["c"], "maxProperties": 2}, [{"c": "x"}, {"a": "x", "c": "y"}],
     [{"a": "x", "b": "y", "c": "z"}, {"a": "x"}]),
])
def test_closed_counts_served_exactly(engine, schema, valid, invalid):
    """llguidance writes a closed object's names in declared order: the count is checked with a
    look-ahead on the names left (a name after which too few, or too many required, remain is
    refused as it is typed)."""
    test_unique_strings_served_exactly(engine, schema, valid, invalid)


def test_closed_count_looks_ahead(engine):
    m = engine.grammar.matcher(GrammarSpec("json_schema", {**ABC, "minProperties": 2}))
    assert not m.accept_string('{"c"')            # one name left after it: too few
    assert m.accept_string('{"b": "x"')
    test_mask_ends_no_repeat_and_leaves_a_way_on(engine, {**ABC, "minProperties": 2}, '{"b": "x"', ["}", '"}'])
    m2 = engine.grammar.matcher(GrammarSpec("json_schema", {**ABC, "required": ["c"], "maxProperties": 2}))
    assert m2.accept_string('{"a": "x"') and not m2.accept_string(', "b"') and m2.accept_string(', "c": "y"}')


TREE = {"$defs": {"node": {"type": "object", "properties": {"name": STR, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}}


def test_recursive_schema_checked_outside_the_recursion():
    """A recursive schema is fine where no check sits under the recursion (its places are then
    finitely many); a unique array inside it stays refused."""
    outside = {**TREE, "type": "object", "properties": {"tree": {"$ref": "#/$defs/node"}, "tags": TAGS}}
    assert check_paths(outside) == frozenset({(("tags",), ("items", None, False))})
    inside = {"$defs": {"node": {"type": "object", "properties": {"tags": TAGS, "kids": {
        "type": "array", "items": {"$ref": "#/$defs/node"}}}}}, "$ref": "#/$defs/node"}
    assert check_paths(inside) is None
