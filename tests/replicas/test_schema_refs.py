"""Recursive references llguidance must intersect (replicas/schema_refs.py): each idiom from
JSONSchemaBench is refused by llguidance as written, and served exactly after the retry that
inlines them: instances jsonschema accepts are accepted through the whole path, those it rejects
are rejected in every key order, and what the grammar writes validates."""

import copy
import json
import random

import jsonschema
import pytest

from replicas.errors import GrammarCompileError
from replicas.grammar import GrammarSpec, _llguidance_compile, _llguidance_schema
from replicas.schema_refs import drop_legacy_ref_siblings, inline_intersected_refs

STR, INT = {"type": "string"}, {"type": "integer"}
DRAFT4, DRAFT7 = "http://json-schema.org/draft-04/schema#", "http://json-schema.org/draft-07/schema#"

IDIOMS = [
    # The Washington Post's ANS schemas: a content object whose promo items are content again,
    # under an anyOf beside type (llguidance intersects each member with {type: object}).
    ("anyOf of a recursive reference beside type",
     {"$schema": DRAFT4, "$ref": "#/definitions/content",
      "definitions": {
          "content": {"type": "object", "properties": {
              "name": STR,
              "promo": {"$ref": "#/definitions/promo"}},
              "required": ["name"], "additionalProperties": False},
          "promo": {"type": "object", "anyOf": [{"$ref": "#/definitions/content"}, {"$ref": "#/definitions/link"}]},
          "link": {"type": "object", "properties": {"url": STR}, "required": ["url"], "additionalProperties": False}}},
     [{"name": "a"}, {"name": "a", "promo": {"url": "u"}}, {"name": "a", "promo": {"name": "b", "promo": {"url": "x"}}}],
     [{"name": 1}, {"name": "a", "promo": {"name": 2}}, {"name": "a", "promo": {}}, {"name": "a", "promo": "s"}]),
    # JSON Schema Store's Minecraft schemas: a number provider whose bounds are number providers,
    # with `type` beside the `$ref` (ignored in draft 7).
    ("draft 7: siblings of a recursive $ref are ignored",
     {"$schema": DRAFT7, "$ref": "#/definitions/num",
      "definitions": {"num": {"anyOf": [
          {"type": "number"},
          {"type": "object", "properties": {
              "min": {"title": "Minimum", "type": ["integer"], "$ref": "#/definitions/num"}},
           "required": ["min"], "additionalProperties": False}]}}},
     [3, 2.5, {"min": 1.5}, {"min": {"min": 2}}],
     ["s", {"min": "x"}, {}, {"min": {"min": None}}]),
    ("allOf of a recursive reference and more",
     {"$ref": "#/$defs/node",
      "$defs": {"node": {"type": "object", "properties": {
          "v": INT,
          "next": {"$ref": "#/$defs/next"}},
          "additionalProperties": False},
          "next": {"allOf": [{"$ref": "#/$defs/node"}, {"required": ["v"]}]}}},
     [{}, {"v": 1}, {"next": {"v": 2}}, {"v": 1, "next": {"v": 2, "next": {"v": 3}}}],
     [{"next": {}}, {"next": {"v": 2, "next": {}}}, {"v": "1"}, {"w": 1}]),
]


def _validator(schema):
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


@pytest.mark.parametrize("idiom,schema,valid,invalid", IDIOMS, ids=[i[0] for i in IDIOMS])
def test_recursive_reference_served_exactly(engine, idiom, schema, valid, invalid):
    from bench.grammar_soundness import Grammar
    v = _validator(schema)
    assert all(v.is_valid(x) for x in valid) and not any(v.is_valid(x) for x in invalid)
    spec = GrammarSpec("json_schema", schema)
    as_written = json.dumps(_llguidance_schema(schema, False))
    import llguidance as llg
    with pytest.raises(GrammarCompileError, match="circular references with sibling keys"):
        _llguidance_compile(*engine.grammar.llg, spec, grammar=llg.LLMatcher.grammar_from_json_schema(as_written))
    g = Grammar(engine.grammar, engine.tokenizer, schema)
    for x in valid:
        assert g.guided(x) is not None, x          # accepted, in some key order
    for x in invalid:
        assert g.guided(x) is None, x              # rejected in every key order
    rng = random.Random(0)
    for _ in range(3):                             # what the grammar writes validates
        text = g.sample(rng)
        assert text is None or v.is_valid(json.loads(text)), text


def test_reference_intersected_within_itself_stays_refused(engine):
    """One level of inlining cannot serve a definition that intersects a reference to itself with
    no plain reference between (the copy needs the same intersection again): refused, with
    llguidance's reason."""
    schema = {"$defs": {"node": {"type": "object", "properties": {
        "next": {"allOf": [{"$ref": "#/$defs/node"}, {"required": ["v"]}]}, "v": INT}}},
        "$ref": "#/$defs/node"}
    with pytest.raises(GrammarCompileError, match="circular references with sibling keys"):
        engine.grammar.compile(GrammarSpec("json_schema", schema))


def test_inlining_keeps_keywords_with_their_node():
    """A ``$ref`` beside other keywords becomes one more ``allOf`` member: the target's
    ``additionalProperties`` stays read beside the target's ``properties``."""
    schema = {"$defs": {"t": {"properties": {"a": INT}, "additionalProperties": False, "$defs": {"x": {}}}},
              "properties": {"p": {"$ref": "#/$defs/t", "properties": {"b": INT}, "title": "P"}}}
    assert inline_intersected_refs(schema) == 1
    assert schema["properties"]["p"] == {"properties": {"b": INT}, "title": "P",
                                         "allOf": [{"properties": {"a": INT}, "additionalProperties": False}]}


def test_no_inlining_under_a_nested_base_uri():
    schema = {"$defs": {"t": {"$id": "http://other.example/t", "type": "object"}},
              "anyOf": [{"$ref": "#/$defs/t"}], "type": "object"}
    before = copy.deepcopy(schema)
    assert inline_intersected_refs(schema) == 0 and schema == before


def test_legacy_siblings_dropped_but_annotations():
    schema = {"properties": {"p": {"$ref": "#/definitions/d", "type": "string", "minimum": 1, "description": "d"}},
              "definitions": {"d": {}}}
    assert drop_legacy_ref_siblings(schema) == 1
    assert schema["properties"]["p"] == {"$ref": "#/definitions/d", "description": "d"}
