"""Soundness / completeness of the schema grammars through the server's routing
(``GrammarCompiler.compile``): instances drawn by hypothesis-jsonschema are accepted, mutated
invalid ones (checked invalid by jsonschema) are rejected, and what the grammar itself samples
validates; for schemas drawn by hypothesis and for a seeded sample of JSONSchemaBench."""

import gzip
import json
import random

import pytest

pytest.importorskip("hypothesis_jsonschema")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from bench import grammar_soundness as gs  # noqa: E402


@pytest.fixture(scope="module")
def compiler():
    return gs._compiler(10.0)


def _check(compiler, schema, **kw):
    tok, gc = compiler
    rec = gs.check_schema(gc, tok, schema, schema_s=60.0, **kw)
    assert rec["status"] in ("served", "refused"), rec
    return rec


def _assert_sound_complete(rec, schema):
    where = json.dumps(schema)[:300]
    assert rec["invalid_accepted"] == 0 and rec["samples_invalid"] == 0, (where, rec["examples"])
    assert rec["valid_rejected"] == 0, (where, rec["examples"])


def test_mutations_are_checked_invalid_and_layouts_follow_schema_order():
    schema = {"type": "object", "properties": {"b": {"type": "integer", "maximum": 3}, "a": {"type": "string"}},
              "required": ["a", "b"], "additionalProperties": False}
    v = gs.validator(schema)
    bad = gs.invalid_instances(v, [{"a": "x", "b": 1}], 20, random.Random(0))
    assert bad and all(not v.is_valid(x) for x in bad)
    assert {"a": "x"} in bad and {"a": "x", "b": 1, "zz_extra": 1} in bad     # required dropped, extra key
    assert gs.layouts({"a": "x", "b": 1.5e-07}, schema)[:2] == ['{"b": 1.5e-07, "a": "x"}', '{"b":1.5e-07,"a":"x"}']
    assert '{"b": 0.00000015, "a": "x"}' in gs.layouts({"a": "x", "b": 1.5e-07}, schema)
    assert gs.typed({"properties": {"a": {"maxLength": 2}}})["properties"]["a"]["type"] == "string"


def test_integral_floats_are_also_written_as_integers(compiler):
    """llguidance writes a multiple of 0.25 as ``-8`` or ``2.50``, never ``-8.0`` or ``2.5``: the
    valid instances -8.0 and 2.5 are produced (the same numbers), and the checker tries them so
    (JSONSchemaBench Github_hard #659's span adjustments were counted as valid rejected)."""
    tok, gc = compiler
    schema = {"type": "object", "properties": {"a": {"type": "number", "multipleOf": 0.25}}}
    g = gs.Grammar(gc, tok, schema)
    assert g.backend == "llguidance" and not g.accepts('{"a": -8.0}') and g.accepts('{"a": -8}')
    assert not g.accepts('{"a": 2.5}') and g.guided({"a": 2.5}) == '{"a": 2.50}'
    assert '{"a": -8}' in gs.layouts({"a": -8.0}, schema)
    v = gs.validator(schema)
    r = gs.check_instances(g, v, [{"a": -8.0}, {"a": 2.5}], [{"a": 1.3}], schema)   # 2.5 as 2.50
    assert (r["valid_rejected"], r["invalid_accepted"]) == (0, 0), r


def test_schema_order_follows_plain_name_refs():
    """A draft-4 ``$ref: "#name"`` (the node whose ``id`` is ``#name``) is followed, so the
    checker writes keys in the order the grammar does (Github_medium #467 was counted as a valid
    instance rejected for want of it)."""
    schema = {"definitions": {"p": {"id": "#param", "type": "object",
                                    "properties": {"priority": {"type": "integer"}, "limit": {"type": "number"}}}},
              "type": "object", "properties": {"min": {"$ref": "#param"}}}
    x = {"min": {"q": True, "limit": 0.1, "priority": 4}}
    assert list(gs.schema_order(x, schema)["min"]) == ["priority", "limit", "q"]
    assert gs._resolve({"$defs": {"a": {"$anchor": "here", "type": "null"}}}, "#here") == {"$anchor": "here", "type": "null"}
    assert gs._resolve(schema, "#nowhere") is None



def test_schema_order_merges_properties_in_the_text_order_of_the_keywords(compiler):
    """llguidance merges an ``allOf``'s members' (or a ``$ref``'s target's) names before a
    node's own ``properties`` where the schema's text lists that keyword first, after them where
    it lists it last; the checker's key order follows (JSONSchemaBench Github_medium #1854, an
    ``allOf`` of shared names before ``properties``, was counted as a valid instance rejected:
    the search ran out of its budget in the order written)."""
    tok, gc = compiler
    prop, x = {"type": "integer"}, {"x": {"properties": {"a": {"type": "integer"}}}}
    before = {"type": "object", "allOf": [{"properties": {"a": prop}}], "properties": {"b": prop}}
    after = {"type": "object", "properties": {"b": prop}, "allOf": [{"properties": {"a": prop}}]}
    ref_before = {"type": "object", "$ref": "#/definitions/x", "properties": {"b": prop}, "definitions": x}
    ref_after = {"type": "object", "properties": {"b": prop}, "$ref": "#/definitions/x", "definitions": x}
    for schema, order in ((before, ["a", "b"]), (after, ["b", "a"]), (ref_before, ["a", "b"]),
                          (ref_after, ["b", "a"])):
        ordered = gs.schema_order({"b": 2, "a": 1}, schema)
        assert list(ordered) == order, schema
        g = gs.Grammar(gc, tok, schema)
        assert g.backend == "llguidance" and g.accepts(json.dumps(ordered)), schema
        assert not g.accepts(json.dumps({k: ordered[k] for k in reversed(order)})), schema

STRINGS = st.one_of(
    st.fixed_dictionaries({"type": st.just("string")}, optional={
        "maxLength": st.integers(1, 8), "minLength": st.integers(0, 3),
        "pattern": st.sampled_from(["^[a-z]+$", "^pkg:", "[0-9]", "^a|b$", "^(ab)+$"])}),
    st.fixed_dictionaries({"type": st.just("string"),
                           "format": st.sampled_from(["date", "date-time", "email", "uuid", "ipv4"])}),
    st.fixed_dictionaries({"enum": st.lists(st.sampled_from(["x", "y", "z\n", 'q"']), min_size=1, max_size=3,
                                            unique=True)}))
NUMBERS = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["integer", "number"])}, optional={
        "minimum": st.integers(-5, 0), "maximum": st.integers(1, 50), "exclusiveMaximum": st.integers(51, 60)}),
    st.fixed_dictionaries({"type": st.just("integer"), "multipleOf": st.sampled_from([2, 5])}),
    st.fixed_dictionaries({"type": st.sampled_from(["boolean", "null"])}))


def _object(values):
    return st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), values, min_size=1, max_size=3).flatmap(
        lambda props: st.fixed_dictionaries({"type": st.just("object"), "properties": st.just(props),
                                             "required": st.lists(st.sampled_from(sorted(props)), unique=True)},
                                            optional={"additionalProperties": st.just(False)}))


LEAVES = st.one_of(STRINGS, NUMBERS)
SCHEMAS = _object(st.one_of(LEAVES, st.fixed_dictionaries(
    {"type": st.just("array"), "items": LEAVES}, optional={"minItems": st.integers(0, 2), "maxItems": st.integers(2, 4)}),
    _object(LEAVES)))


@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(schema=SCHEMAS)
def test_drawn_schemas_sound_and_complete(compiler, schema):
    rec = _check(compiler, schema, n_valid=3, n_invalid=6, n_samples=1)
    assert rec["status"] == "served", rec          # every keyword drawn is served by one backend
    _assert_sound_complete(rec, schema)


def _bench_sample(n: int, seed: int):
    """``n`` JSONSchemaBench schemas drawn with ``seed`` from the subsets whose schemas compile in
    well under a second (the rest are covered by ``python -m bench.grammar_soundness``)."""
    rows = []
    for name in ("Github_trivial", "Github_easy", "Glaiveai2K", "Snowplow", "WashingtonPost"):
        with gzip.open(gs.JSONSCHEMABENCH_DIR / f"{name}.jsonl.gz", "rt") as f:
            rows += [(name, i, json.loads(line)["json_schema"]) for i, line in enumerate(f)]
    return random.Random(seed).sample(rows, n)


def test_jsonschemabench_sample_sound_and_complete(compiler):
    if not gs.JSONSCHEMABENCH_DIR.is_dir():
        pytest.skip("JSONSchemaBench is not in ../shared/data")
    served = 0
    for name, i, schema in _bench_sample(30, seed=0):
        schema = json.loads(schema) if isinstance(schema, str) else schema
        rec = _check(compiler, schema, n_valid=3, n_invalid=6, n_samples=1, seed=i)
        if rec["status"] == "served":
            served += 1
            _assert_sound_complete(rec, {"subset": name, "i": i})
    assert served >= 20


def test_guided_searches_key_orders(compiler):
    """A union of objects whose members declare their keys in different orders (llguidance writes
    each member's keys in its order): the first key the matcher takes may lead nowhere, and the
    search backs up to another order (a greedy writer called the valid instance rejected;
    JSONSchemaBench Github_trivial #238)."""
    tok, gc = compiler
    member = lambda *names: {"type": "object", "additionalProperties": False,   # noqa: E731
                             "properties": {n: {"type": "string"} for n in names}}
    schema = {"anyOf": [member("req"), member("extra", "req")], "required": ["req"]}
    g = gs.Grammar(gc, tok, schema)
    assert g.backend == "llguidance"
    assert not g.accepts('{"req": "a", "extra": "b"}')   # the instance's own order is not writable
    assert g.guided({"req": "a", "extra": "b"}) == '{"extra": "b", "req": "a"}'
    assert g.guided({"req": "a", "other": "b"}) is None


def test_guided_backs_up_into_a_nested_object_when_a_later_key_fails(compiler):
    """JSONSchemaBench JsonSchemaStore #63, cut down: under a union, a nested object's keys fit
    the open member in the order written, and only then does a later sibling (its string
    pattern) rule that member out; the other member writes the nested keys in another order.
    The search must undo the nested object's order, not only the outer one (a search that
    backed up one object at a time called this valid instance rejected)."""
    tok, gc = compiler
    schema = {"type": "object", "required": ["f"],
              "properties": {"m": {"type": "object"}, "f": {"type": "string"}},
              "oneOf": [{"properties": {"m": {"properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
                                        "f": {"pattern": "\\.js$"}}},
                        {"properties": {"m": {"properties": {"b": {"type": "integer"}},
                                              "allOf": [{"properties": {"a": {"type": "integer"}}}]},
                                        "f": {"pattern": "\\.css$"}}}]}
    g = gs.Grammar(gc, tok, schema)
    assert g.backend == "llguidance"
    x = {"m": {"a": 1, "b": 2}, "f": "x.css"}
    assert not g.accepts(json.dumps(x))
    assert g.guided(x) == '{"m": {"b": 2, "a": 1}, "f": "x.css"}'
    assert g.guided({"m": {"a": 1, "b": 2}, "f": "x.txt"}) is None   # neither member: invalid
    # and the key order of the schema follows the member the instance fits (the css one)
    assert json.dumps(gs.schema_order(x, schema)) == '{"m": {"b": 2, "a": 1}, "f": "x.css"}'
    assert g.accepts(gs.layouts(x, schema)[0])


def test_reference_reads_pattern_properties_as_ecma_in_additional_properties():
    """The reference validator reads ``\\d`` as ECMA-262 (ASCII) in the keys
    ``additionalProperties`` counts too: jsonschema's own took a key of Unicode digits as matching
    the pattern, so it was not additional (JSONSchemaBench Github_easy #1922)."""
    schema = {"type": "object", "patternProperties": {"^[a-f\\d]{2}$": {"type": "integer"}},
              "additionalProperties": False}
    v = gs.validator(schema)
    assert gs.is_valid(v, {"a1": 1}) and not gs.is_valid(v, {"a1": "x"})
    assert not gs.is_valid(v, {"\u0e53\u0e53": 1})   # Thai digits: \d in Python's re, not in ECMA
    assert gs.is_valid(gs.validator({**schema, "additionalProperties": {"type": "string"}}), {"\u0e53\u0e53": "x"})


def test_text_naming_a_special_token_is_fed_as_characters(compiler):
    """A string that spells a special token (``"<|im_end|>"``) is characters to the grammar, as
    the model writes it: the checker tokenizes with special tokens split (CI drew such a key from
    hypothesis's constants pool for JSONSchemaBench Github_easy #1231 and called it rejected)."""
    tok, gc = compiler
    schema = {"type": "object", "additionalProperties": {"type": "array"}}
    g = gs.Grammar(gc, tok, schema)
    assert g.accepts('{"<|im_end|>": []}') and g.guided({"<|im_end|>": []}) == '{"<|im_end|>": []}'
    rec = gs.check_instances(g, gs.validator(schema), [{"<|im_end|>": []}], [], schema)
    assert rec["valid_rejected"] == 0


def test_text_naming_an_added_token_is_fed_as_characters(compiler):
    """``<tools>`` is an added (not special) token: llguidance keeps it out of JSON strings, where
    the model spells it in pieces, so the checker does too (hypothesis drew the key
    ``<tools>(.*?)</tools>``, a constant of models/chat.py, for Github_easy #1231)."""
    tok, gc = compiler
    schema = {"type": "object", "patternProperties": {"^x": {"type": "integer"}}}   # (llguidance)
    g = gs.Grammar(gc, tok, schema)
    assert g.backend == "llguidance"
    assert len(tok("<tools>", add_special_tokens=False)["input_ids"]) == 1
    assert g.guided({"a": {"<tools>(.*?)</tools>": []}}) == '{"a": {"<tools>(.*?)</tools>": []}}'
    assert g.accepts('{"x<tools>": 1}') and not g.accepts('{"x<tools>": "s"}')


def test_escaped_names_layout_decodes_to_the_same_instance():
    x = {"a": 1, "bc": {"d": [1, {"": 2}]}, "": 3, "\U0001F600": 4}
    text = gs.escaped_names(x)
    assert text.startswith('{"\\u0061": 1, "\\u0062c": {"\\u0064"') and json.loads(text) == x
    assert gs.escaped_names([1, {"": 2}]) is None   # no name to escape


def test_repeated_names_are_counted_as_invalid_texts(compiler):
    """Every valid instance with an object is also written with a name repeated; a grammar that
    takes it counts an invalid accepted (the server's matcher refuses it on both backends)."""
    x = {"a": 1, "b": {"c": [{"d": 2}], "e": {}}}
    text = gs.repeated_names(x)
    assert text == '{"a": 1, "a": 1, "b": {"c": [{"d": 2, "d": 2}], "c": [{"d": 2, "d": 2}], "e": {}}}'
    assert json.loads(text) == x
    assert gs.repeated_names([1, {}]) is None

    class TakesAll:
        def accepts(self, text):
            return True

        def guided(self, x):
            return None
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 2}
    v = gs.validator(schema)
    rec = gs.check_instances(TakesAll(), v, [{"a": 1, "b": 2}], [], schema)
    assert (rec["invalid"], rec["invalid_accepted"], rec["examples"][0][0]) == (1, 1, "repeated name accepted")
    tok, gc = compiler
    for backend in ("xgrammar", "llguidance"):
        g = gs.Grammar(gc, tok, schema, backend=backend)
        assert g.accepts('{"a": 1, "b": 2}') and not g.accepts('{"a": 1, "a": 1}')
        rec = gs.check_instances(g, v, [{"a": 1, "b": 2}], [], schema)
        assert (rec["invalid"], rec["invalid_accepted"], rec["valid_rejected"]) == (1, 0, 0), backend


def test_valid_rejected_by_a_format_kept_stricter_than_the_draft_is_counted_apart(compiler):
    """Under draft 7 ``format: uuid`` is an annotation (any string is valid); the server enforces
    it anyway (as 2019-09 does): such a rejection is counted apart from ``valid_rejected``, and one
    the stricter format does not explain still counts there."""
    tok, gc = compiler
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "string", "format": "uuid"}
    g = gs.Grammar(gc, tok, schema)
    v = gs.validator(schema)
    assert gs.is_valid(v, "not a uuid") and not g.accepts('"not a uuid"')
    rec = gs.check_instances(g, v, ["not a uuid", "123e4567-e89b-12d3-a456-426614174000"], [], schema)
    assert (rec["valid_rejected"], rec["valid_rejected_format"]) == (0, 1)
    assert gs.stricter_validator({"type": "string", "format": "uuid"}) is None   # 2020-12 checks it

    class TakesNothing:
        def accepts(self, text):
            return False

        def guided(self, x):
            return None
    rec = gs.check_instances(TakesNothing(), v, ["123e4567-e89b-12d3-a456-426614174000"], [], schema)
    assert (rec["valid_rejected"], rec["valid_rejected_format"]) == (1, 0)


def test_reference_reads_dollar_as_ecma():
    """ECMA-262's ``$`` matches at the end only; Python's also before a final newline, so the
    reference took ``"abc\\n"`` for ``^[a-z]+$`` (hypothesis draws such strings from patterns)."""
    v = gs.validator({"type": "string", "pattern": "^[a-z]+$"})
    assert gs.is_valid(v, "abc") and not gs.is_valid(v, "abc\n")
    assert gs.is_valid(gs.validator({"type": "string", "pattern": "^[$]x$"}), "$x")
    assert gs._ecma_end(r"a\$[]$]$") == r"a\$[]$]\Z"


def test_enum_objects_are_tried_in_xgrammar_compact_literal_layout(compiler):
    """xgrammar writes an object listed in an ``enum`` / ``const`` compact (``{"b":1}``) inside
    text whose other separators are ``", "`` / ``": "``: the instance is producible, so a layout
    writes such literals that way (JSONSchemaBench Github_easy #153 counted valid rejected)."""
    tok, gc = compiler
    schema = {"type": "object", "additionalProperties": False, "required": ["a"],
              "properties": {"a": {"type": "object", "enum": [{"$data": "1/x", "n": 1}]}, "b": {"type": "string"}}}
    g = gs.Grammar(gc, tok, schema)
    x = {"b": "s", "a": {"n": 1.0, "$data": "1/x"}}
    texts = gs.layouts(x, schema)
    assert '{"a": {"$data":"1/x","n":1}, "b": "s"}' in texts
    assert all(json.loads(t) == x for t in texts)
    assert any(g.accepts(t) for t in texts)
    assert not any('"n":1' in t for t in gs.layouts({"a": {"$data": "1/x", "n": True}}, schema))   # true is not 1
    rec = _check(compiler, schema)
    _assert_sound_complete(rec, schema)


def test_required_names_not_declared_are_laid_out_in_required_order(compiler):
    """llguidance writes names ``required`` but not in ``properties`` in ``required`` order
    (JSONSchemaBench Github_medium #781: 18 required type names under ``patternProperties``,
    past the guided search's key budget in any other order)."""
    tok, gc = compiler
    names = [f"k{i}" for i in range(18)]
    schema = {"type": "object", "patternProperties": {"^k[0-9]+$": {"type": "number"}},
              "required": names[::-1], "additionalProperties": False}
    x = {n: 1 for n in names}
    assert list(gs.schema_order(x, schema)) == names[::-1]
    g = gs.Grammar(gc, tok, schema)
    assert g.backend == "llguidance" and any(g.accepts(t) for t in gs.layouts(x, schema))
