"""Constrained decoding: each grammar kind constrains the engine's output; bad grammars raise
GrammarCompileError; BFCL's ground-truth calls pass the tool grammar."""

import json

import jsonschema
import pytest

from models import bfcl, chat
from replicas.errors import GrammarCompileError
from replicas.grammar import GrammarSpec
from replicas.sampling_params import SamplingParams

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                           "unit": {"enum": ["c", "f"]}},
          "required": ["city", "days", "unit"], "additionalProperties": False}

# SCHEMA without its length bound (a length bound sends a schema to llguidance: xgrammar refuses
# JSON escapes in bounded strings).
SCHEMA_XGR = {**SCHEMA, "properties": {**SCHEMA["properties"], "city": {"type": "string"}}}


def run(engine, prompt, spec, **kw):
    return engine.generate([prompt], SamplingParams(max_tokens=kw.pop("max_tokens", 64), **kw), [spec])[0]


def test_json_schema_output_validates(engine, chat_prompts):
    for seed in range(3):
        out = run(engine, chat_prompts[0], GrammarSpec("json_schema", SCHEMA), temperature=1.0, seed=seed)
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_choice_regex_and_json_object(engine, chat_prompts):
    assert run(engine, chat_prompts[1], GrammarSpec("choice", ["yes", "no", "maybe"])).text in ("yes", "no", "maybe")
    import re
    assert re.fullmatch(r"[a-c]{2}\d", run(engine, chat_prompts[1], GrammarSpec("regex", r"[a-c]{2}\d")).text)
    out = run(engine, chat_prompts[2], GrammarSpec("json_object"), max_tokens=300)
    assert out.text.startswith("{")
    if out.finish_reason == "stop":  # a weak model may ramble past max_tokens inside a string
        assert isinstance(json.loads(out.text), dict)
    ebnf = 'root ::= "x" ("y" | "z")'
    assert run(engine, chat_prompts[2], GrammarSpec("ebnf", ebnf)).text in ("xy", "xz")
    lark = 'start: "x" ("y" | "z") DIGIT\nDIGIT: /[0-9]/'
    assert re.fullmatch(r"x[yz]\d", run(engine, chat_prompts[2], GrammarSpec("lark", lark)).text)


def test_tool_grammar_required_and_named(engine, chat_prompts):
    tools = [bfcl.to_openai_tool(f) for f in bfcl.load_questions("multiple")[0].functions]
    names = {t["function"]["name"] for t in tools}
    out = run(engine, chat_prompts[3], GrammarSpec("tools", {"tools": tools, "tool_choice": "required"}),
              max_tokens=300)
    assert any(out.text.startswith(f'<tool_call>\n{{"name": "{n}", "arguments": {{') for n in names)
    if out.finish_reason == "stop":
        calls, _ = chat.parse_tool_calls(out.text)
        assert calls and all(c["name"] in names for c in calls)
    name = tools[-1]["function"]["name"]
    named = {"type": "function", "function": {"name": name}}
    out = run(engine, chat_prompts[3], GrammarSpec("tools", {"tools": tools, "tool_choice": named}), max_tokens=300)
    assert out.text.startswith(f'<tool_call>\n{{"name": "{name}", "arguments": {{')
    if out.finish_reason == "stop":
        calls, _ = chat.parse_tool_calls(out.text)
        assert [c["name"] for c in calls] == [name]
        jsonschema.validate(calls[0]["arguments"], tools[-1]["function"]["parameters"])


def test_tool_grammar_bounds_whitespace_inside_calls(engine):
    """Runs of whitespace between a call's JSON tokens are bounded (they were not: a weak model
    could write newlines until max_tokens cut the call); whitespace inside strings is text."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "required": ["a"]}}}
    spec = GrammarSpec("tools", {"tools": [tool], "tool_choice": "required"})

    def accepts(arguments):
        m = engine.grammar.matcher(spec)
        return m.accept_string(f'<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>')
    assert accepts('{"a": "x", "b": 1}') and accepts('{\n "a": "x",\n "b": 1}') and accepts('{"a": "x   \\n\\n  y"}')
    for spaced in ('{\n\n\n"a": "x"}', '{"a":' + " " * 3 + '"x"}', '{"a": "x"' + "\n" * 200 + "}"):
        assert not accepts(spaced), spaced


@pytest.mark.parametrize("spec,match", [
    (GrammarSpec("json_schema", {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}), "invalid json_schema"),
    (GrammarSpec("json_schema", "{not json"), "invalid json_schema"),
    (GrammarSpec("regex", "(unclosed"), "invalid regex"),
    (GrammarSpec("ebnf", "root ::= undefined_rule"), "invalid ebnf"),
    (GrammarSpec("lark", "start: undefined_rule"), "invalid lark"),
    (GrammarSpec("lark", ""), "needs non-empty text"),
    (GrammarSpec("choice", []), "non-empty list"),
    (GrammarSpec("tools", {"tools": []}), "at least one tool"),
])
def test_bad_grammars_raise_typed_error_and_engine_keeps_serving(engine, chat_prompts, spec, match):
    with pytest.raises(GrammarCompileError, match=match):
        engine.add_request("bad-grammar", chat_prompts[0], SamplingParams(max_tokens=4), spec)
    assert engine.generate([chat_prompts[0]], SamplingParams(max_tokens=3))[0].finished


def test_unknown_kind():
    with pytest.raises(GrammarCompileError, match="unknown grammar kind"):
        GrammarSpec("peg", "start <- x")


# Ground-truth entries that contradict their own function schema in the BFCL data itself: no
# schema-valid output can equal them, so the grammar rightly refuses them.
BFCL_DATA_ISSUES = {
    "parallel_multiple_21": "a variable name (\"data['future_sales']\") where the schema asks for an array",
    "parallel_multiple_26": "a parameter 'type' that calculate_balance's schema does not have",
    "parallel_multiple_94": "strings for sort_list's integer-array parameter",
}


@pytest.mark.slow
def test_every_bfcl_ground_truth_passes_schema_and_grammar():
    from bench.grammar_coverage import bfcl_coverage
    report = bfcl_coverage(timeout_s=30)
    assert report["functions_compiled"] == report["functions"] > 1000
    assert {f["id"] for f in report["failures"]} == set(BFCL_DATA_ISSUES)
    assert report["calls"] > 1800
    assert report["calls_schema_valid"] >= report["calls"] - 2
    assert report["calls_grammar_accepted"] >= report["calls"] - 8


def _accepts(matcher, tokenizer, text: str) -> bool:
    """The whole path: ``text`` token by token (as the model would write it), then EOS."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(tokenizer.eos_token_id) \
        and matcher.is_terminated()


def _pydantic_schemas():
    from typing import Literal, Union

    from pydantic import BaseModel, Field

    class Cat(BaseModel):
        kind: Literal["cat"]
        lives: int

    class Dog(BaseModel):
        kind: Literal["dog"]
        bark: str

    class Pet(BaseModel):
        pet: Union[Cat, Dog] = Field(discriminator="kind")

    class Code(BaseModel):
        code: str = Field(pattern="^[A-Z]+$", max_length=3)
    return Pet.model_json_schema(), Code.model_json_schema()


PET, CODE = _pydantic_schemas()

# Keyword classes xgrammar 0.2.9 does not enforce (unenforced_keywords finds them; each was seen
# letting schema-breaking output through) and llguidance does: (schema, what unenforced_keywords
# says, a valid instance, an invalid one the grammar must reject).
MOVED_TO_LLGUIDANCE = [
    ({"type": "number", "multipleOf": 0.5}, "multipleOf at $", "1.5", "1.3"),
    ({"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 20}, "multipleOf at $", "9", "10"),
    ({"allOf": [{"type": "integer"}, {"minimum": 5}, {"maximum": 8}]}, "allOf at $", "7", "9"),
    ({"type": "object", "properties": {"b": {"type": "string", "pattern": "^a+$", "maxLength": 4}}},
     "pattern with minLength / maxLength at $.properties.b", '{"b": "aaa"}', '{"b": "aaaaa"}'),
    ({"type": "string", "format": "date"}, "format date at $", '"2020-02-28"', '"2020-02-31"'),
    # xgrammar took a 64-character label (and refused "A.COM" and a final dot: JSONSchemaBench)
    ({"type": "string", "format": "hostname"}, "format hostname at $", '"A-9.COM."', '"' + "x" * 64 + '.com"'),
    # a node without "type": xgrammar took any value, its keywords dropped (JSONSchemaBench
    # Github_medium #7 let " 00/0" past a pattern; a misspelled "type" key)
    ({"type": "object", "properties": {"r": {"pattern": "^a+$"}}, "required": ["r"]},
     "pattern without type at $.properties.r", '{"r": "aa"}', '{"r": "b"}'),
    ({"type": "object", "properties": {"r": {"minimum": 3}}, "required": ["r"]},
     "minimum without type at $.properties.r", '{"r": 5}', '{"r": 1}'),
    ({"type": "object", "properties": {"r": {"maxItems": 1}}, "required": ["r"]},
     "maxItems without type at $.properties.r", '{"r": [1]}', '{"r": [1, 2]}'),
    # xgrammar refused RFC 5321 addresses hypothesis writes (JSONSchemaBench: "h@x.M.AIG", "N&@ZvIMDNu.Z.Hn")
    ({"type": "string", "format": "email"}, "format email at $", '"N&~-x.y@ZvIMDNu.Z.AIG"', '"h.x.M.AIG"'),
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "additionalProperties": False},
     "patternProperties at $", '{"xa": 1}', '{"xa": "s"}'),
    ({"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["b"]}, "required b not in properties",
     '{"a": true, "b": 1}', '{"a": true}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "anyOf": [{"required": ["a"]}]},
     "anyOf beside type, properties", '{"a": 1}', '{}'),
    ({"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "enum": ["x"]}, "$ref beside enum", '"x"', '"y"'),
    ({"type": "string", "enum": ["a", 1]}, "outside type string", '"a"', '1'),
    ({"type": "string", "pattern": "^v(?:\\s*\\+json)?$"}, "optional group that starts with an optional atom",
     '"v +json"', '"v "'),
    ({"type": "string", "pattern": "^([ZB][1-9][0-9]*)?K[1-9][0-9]*$"}, "optional group that starts or ends with a repeated atom",
     '"Z1K1"', '"434602470600400302K144"'),   # a grammar sample of xgrammar's (bench.grammar_soundness)
    ({"type": "string", "pattern": "^-?P([0-9]+Y)?([0-9]+M)?([0-9]+D)?(T([0-9]+H)?([0-9]+M)?([0-9]+S)?)?$"},
     "optional group that starts or ends with a repeated atom", '"P1Y2DT3H"', '"-P9"'),   # JSONSchemaBench's ISO 8601 duration
    # an optional group ending with a bounded variable count: xgrammar took "...:570" (Github_medium #1452)
    ({"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\\.[0-9]{1,4})?$"},
     "optional group that starts or ends with a repeated atom", '"2026-12-07T06:45:00.25"', '"2026-12-07T06:45:570"'),
    # an alternation holding a bounded repeat: xgrammar took "0000" (a random pattern against Python's re)
    ({"type": "string", "pattern": "^(0{1,2}|0)$"}, "alternation holding a bounded repeat", '"00"', '"0000"'),
    # semver's build part ends with a group that ends with *: xgrammar took "1.0.0.a" (JsonSchemaStore's semver)
    ({"type": "string", "pattern": "^(0|[1-9]\\d*)\\.(0|[1-9]\\d*)\\.(0|[1-9]\\d*)(?:\\+([0-9a-z-]+(?:\\.[0-9a-z-]+)*))?$"},
     "optional group that starts or ends with a repeated atom", '"1.0.0+b.7"', '"1.0.0.a"'),
    # a property named like a pattern: xgrammar took the key as any other (its schema unchecked)
    ({"type": "object", "properties": {"^\\w+$": {"type": "object", "properties": {"col": {"type": "number"}},
                                                 "required": ["col"]}}},
     "property name JSON escapes", '{"^\\\\w+$": {"col": 1}}', '{"^\\\\w+$": {}}'),
    ({"type": "object", "properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}},
     "dependentRequired at $", '{"a": 1, "b": 2}', '{"a": 1}'),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "properties": {"a": {}, "c": {}},
      "dependencies": {"a": {"required": ["c"]}}},
     "dependencies at $", '{"a": 1, "c": 2}', '{"a": 1}'),
    (PET, "oneOf with members that may overlap", '{"pet": {"kind": "cat", "lives": 9}}',
     '{"pet": {"kind": "cat", "bark": "x"}}'),   # a pydantic discriminated union
    (CODE, "pattern with minLength / maxLength", '{"code": "AB"}', '{"code": "ABCD"}'),  # Field(pattern, max_length)
    # members that overlap (both required names present): rewritten as an exact anyOf (schema_oneof)
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "oneOf": [{"required": ["a"]}, {"required": ["b"]}]}, "oneOf with members that may overlap", '{"a": 1}',
     '{"a": 1, "b": 2}'),
]


@pytest.mark.parametrize("schema,needle,valid,invalid", MOVED_TO_LLGUIDANCE)
def test_keywords_xgrammar_drops_are_served_by_llguidance(engine, schema, needle, valid, invalid):
    """Schema in, backend chosen, the matcher accepts the valid instance and rejects the invalid
    one token by token (then EOS); both validate as expected with jsonschema."""
    from replicas.grammar import GrammarSpec, unenforced_keywords
    assert any(needle in x for x in unenforced_keywords(schema)), unenforced_keywords(schema)
    validator = jsonschema.validators.validator_for(schema)(schema, format_checker=jsonschema.FormatChecker())
    assert validator.is_valid(json.loads(valid)) and not validator.is_valid(json.loads(invalid))
    spec = GrammarSpec("json_schema", schema)
    assert engine.grammar.backend_of(spec) == "llguidance"
    assert engine.grammar.matcher(spec).backend == "llguidance"
    assert _accepts(engine.grammar.matcher(spec), engine.tokenizer, valid)
    assert not _accepts(engine.grammar.matcher(spec), engine.tokenizer, invalid)
    # The same as a tool's parameters (root-relative $refs stay at the root).
    wrap = schema.get("type") != "object"
    if wrap and "$ref" in json.dumps(schema):
        return
    params = {"type": "object", "properties": {"x": schema}, "required": ["x"]} if wrap else schema
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    tools = GrammarSpec("tools", {"tools": [tool], "tool_choice": "required"})
    assert engine.grammar.backend_of(tools) == "llguidance"
    call = '<tool_call>\n{"name": "f", "arguments": %s}\n</tool_call>' % ('{"x": %s}' if wrap else "%s")
    assert _accepts(engine.grammar.matcher(tools), engine.tokenizer, call % valid)
    assert not _accepts(engine.grammar.matcher(tools), engine.tokenizer, call % invalid)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {}, "b": {}}, "dependencies": {"a": ["b"]}},   # 2020-12: no dependencies
    {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "properties": {"a": {}, "b": {}},
     "dependentRequired": {"a": ["b"]}},                                                  # draft 7: no dependentRequired
])
def test_dependency_keywords_of_another_draft_are_ignored_as_jsonschema_does(engine, schema):
    """Seen on JSONSchemaBench (Glaiveai2K #765, no $schema, draft-4 `dependencies`): jsonschema
    ignores a keyword its draft does not have, so the grammar must accept what it would forbid."""
    from replicas.grammar import GrammarSpec
    validator = jsonschema.validators.validator_for(schema)(schema)
    assert validator.is_valid({"a": 1})
    spec = GrammarSpec("json_schema", schema)
    assert engine.grammar.backend_of(spec) == "llguidance"
    assert _accepts(engine.grammar.matcher(spec), engine.tokenizer, '{"a": 1}')


# Found by bench.grammar_soundness / its probes: schemas xgrammar serves but with valid instances
# it rejects (incomplete_keywords: completeness) or invalid ones it accepts, and llguidance's own
# holes closed by a rewrite (_FORMAT_PATTERNS). (schema, the place found, a valid instance, an
# invalid one, whether xgrammar alone rejected the valid one).
MOVED_FOR_COMPLETENESS = [
    ({"type": "string", "pattern": "^pkg:"}, "pattern not anchored at both ends at $", '"pkg:x"', '"xpkg:"', True),
    ({"type": "object", "properties": {"n": {"type": "string", "pattern": "[0-9]"}}},
     "pattern not anchored at both ends at $.properties.n", '{"n": "ab1cd"}', '{"n": "abc"}', True),
    ({"type": "string", "pattern": "^a|b$"}, "pattern not anchored", '"xb"', '"xa"', True),
    ({"type": "string", "maxLength": 5}, "string length bound at $", '"a\\nb"', '"abcdef"', True),
    ({"type": "string", "minLength": 2}, "string length bound at $", '"\\"\\""', '"a"', True),
    ({"maxLength": 3}, "string length bound at $", '"a\\"b"', '"abcd"', False),   # xgrammar accepted "abcd"
    ({"type": "string", "format": "uri-reference"}, "format uri-reference at $", '"https://x.org/a?b#c"',
     '"a b"', True),
    ({"type": "number", "minimum": -360, "maximum": 360}, "number with a bound at $", "2.9294384834", "360.0001",
     True),
    ({"type": "string", "pattern": "^[\\S]+$"}, "pattern that may match a character JSON escapes at $",
     '"a\\"b"', '"a b"', True),
    # a class range over an escaped character (bench.pattern_crosscheck jsonschemabench, stop 45)
    ({"type": "string", "pattern": "^[a-zA-z_]+$"}, "pattern that may match a character JSON escapes at $",
     '"a\\\\b"', '"a b"', True),
    ({"type": "string", "pattern": "^[0-9a-zA-Z -_]*$"}, "pattern that may match a character JSON escapes at $",
     '"x\\"y"', '"x~"', True),
    ({"type": "string", "format": "time"}, "format time at $", '"10:00:00.5+01:00"', '"23:59:60Z"', False),
    # llguidance's own date-time took second 60 at any minute; the pattern rewrite closes it
    ({"type": "string", "format": "date-time"}, "format date-time at $", '"2020-02-29T10:00:00Z"',
     '"2020-01-01T11:14:60Z"', False),
    ({"type": "string", "format": "date"}, "format date at $", '"2000-02-29"', '"1900-02-29"', False),
]


@pytest.mark.parametrize("schema,needle,valid,invalid,xgr_rejects_valid", MOVED_FOR_COMPLETENESS)
def test_schemas_xgrammar_serves_incompletely_go_to_llguidance(engine, schema, needle, valid, invalid,
                                                               xgr_rejects_valid):
    from replicas.grammar import GrammarSpec, XGrammarMatcher, _check, incomplete_keywords, unenforced_keywords
    assert any(needle in x for x in incomplete_keywords(schema) + unenforced_keywords(schema))
    cls = jsonschema.validators.validator_for(schema)
    validator = cls(schema, format_checker=cls.FORMAT_CHECKER)   # (FormatChecker() checks time as draft 3)
    assert validator.is_valid(json.loads(valid)) and not validator.is_valid(json.loads(invalid))
    spec = GrammarSpec("json_schema", schema)
    assert engine.grammar.backend_of(spec) == "llguidance"
    assert _accepts(engine.grammar.matcher(spec), engine.tokenizer, valid)
    assert not _accepts(engine.grammar.matcher(spec), engine.tokenizer, invalid)
    if xgr_rejects_valid:   # why it moved: xgrammar alone rejects the valid instance
        xgr = XGrammarMatcher(engine.grammar._compile_backend("xgrammar", _check(spec))[0])
        assert not _accepts(xgr, engine.tokenizer, valid)


def test_schema_moved_for_completeness_falls_back_to_xgrammar_where_llguidance_refuses(engine):
    """A length bound sends the schema to llguidance, which refuses maxProperties beside optional
    keys (and the text check leaves it, a name being required); xgrammar enforces all of it, so
    it serves (rejecting the escapes it always did)."""
    from replicas.grammar import GrammarSpec
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}, "b": {"type": "integer"}},
              "required": ["a"], "maxProperties": 1}
    spec = GrammarSpec("json_schema", schema)
    assert engine.grammar.backend_of(spec) == "xgrammar"
    assert _accepts(engine.grammar.matcher(spec), engine.tokenizer, '{"a": "ab"}')
    for bad in ('{"a": "abcd"}', '{"a": "ab", "b": 1}'):
        assert not _accepts(engine.grammar.matcher(spec), engine.tokenizer, bad)


@pytest.mark.parametrize("kind", ["integer", "number"])
@pytest.mark.parametrize("keyword", ["maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum"])
def test_integer_bounds_past_doubles_are_served_soundly_by_both_backends(engine, kind, keyword):
    """Both backends read a bound as a double, ``jsonschema`` compares exact ints: before
    ``_exact_bounds``, llguidance took 9007199254740996 under ``"maximum": 9007199254740995``, and
    neither served a 64-bit limit (``"maximum": 9223372036854775807`` for numbers in llguidance,
    ``-9223372036854775807`` as a minimum). Every text near each bound that a grammar accepts
    validates, and the bound's side well inside is accepted."""
    from replicas.grammar import GrammarSpec, _check
    sign = 1 if "Maximum" in keyword or keyword == "maximum" else -1
    for v in (9007199254740995, 9223372036854775807, 2**64 + 1):
        schema = {"type": kind, keyword: sign * v}
        validator = jsonschema.Draft202012Validator(schema)
        texts = [str(sign * (v + d)) for d in range(-3, 4)]
        if kind == "number":
            texts += [f"{sign * (v + d)}.5" for d in (-2, -1, 0)]
        for backend in ("xgrammar", "llguidance"):
            compiled = engine.grammar._compile_backend(backend, _check(GrammarSpec("json_schema", schema)))[0]
            for text in texts:
                if _accepts(engine.grammar.matcher_of(compiled), engine.tokenizer, text):
                    assert validator.is_valid(json.loads(text)), (backend, schema, text)
            inside = str(sign * min(v - 2**20, 2**62))   # (bounds past 2**63 are clamped below it)
            assert _accepts(engine.grammar.matcher_of(compiled), engine.tokenizer, inside), (backend, schema)


def test_schema_xgrammar_refuses_for_its_own_limit_is_served_by_llguidance(engine):
    """JSONSchemaBench Github_easy #16: a property whose schema is ``false`` (it must be absent)
    makes xgrammar's compiler refuse the schema ("Schema 'false' cannot accept any value"),
    though it enforces every keyword; llguidance serves it whole."""
    from replicas.grammar import GrammarSpec, _check, backend_for
    from replicas.errors import GrammarCompileError
    schema = {"type": "object", "properties": {"gone": False, "n": {"type": "integer", "minimum": 1}},
              "required": ["n"], "additionalProperties": False}
    spec = GrammarSpec("json_schema", schema)
    assert backend_for(_check(spec)) == "xgrammar"
    with pytest.raises(GrammarCompileError, match="cannot accept any value"):
        engine.grammar._compile_backend("xgrammar", _check(spec))
    assert engine.grammar.backend_of(spec) == "llguidance"
    assert _accepts(engine.grammar.matcher(spec), engine.tokenizer, '{"n": 2}')
    for bad in ('{"n": 2, "gone": 1}', '{"n": 0}', '{"gone": null}', '{}'):
        assert not _accepts(engine.grammar.matcher(spec), engine.tokenizer, bad)


@pytest.mark.parametrize("schema,needle", [
    ({"type": "array", "items": {"type": "integer", "maximum": 9}, "uniqueItems": True}, "uniqueItems at $"),
    ({"type": "array", "contains": {"const": 3}}, "contains at $"),
    # (not const 0, if required then required: now rewritten exactly, tests/replicas/test_grammar_rewrites.py)
    ({"type": "integer", "not": {"multipleOf": 2}}, "not at $"),
    ({"type": "object", "if": {"properties": {"a": {"pattern": "^(?=x)"}}}, "then": {"required": ["b"]}}, "if at $"),
    ({"type": "string", "oneOf": [{"format": "uuid"}, {"format": "uri"}]}, "oneOf with members that may overlap at $"),
    ({"$ref": "http://example.com/x.json"}, "not a local JSON pointer"),
    ({"type": "object", "properties": {"p": {"type": "string", "pattern": "^((?!x).)*$"}}},
     "pattern with look-around at $.properties.p"),
    ({"type": "object", "propertyNames": {"pattern": "^a"}, "patternProperties": {"^a": {}}}, "propertyNames at $"),
])
def test_keywords_neither_backend_enforces_are_refused_with_where(engine, schema, needle):
    """Refused (400 through the API), naming the keyword and where it is."""
    from replicas.errors import GrammarCompileError
    from replicas.grammar import GrammarSpec
    with pytest.raises(GrammarCompileError, match="cannot enforce") as e:
        engine.grammar.compile(GrammarSpec("json_schema", schema))
    assert needle in str(e.value), str(e.value)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": schema}}}}
    with pytest.raises(GrammarCompileError, match="tool 'f' uses .*cannot enforce"):
        engine.grammar.compile(GrammarSpec("tools", {"tools": [tool]}))


def test_schema_xgrammar_enforces_stays_on_xgrammar(engine):
    from replicas.grammar import GrammarSpec
    for spec in (GrammarSpec("json_schema", SCHEMA_XGR), GrammarSpec("json_schema", SCHEMA_XGR, strict=True),
                 GrammarSpec("json_object"), GrammarSpec("regex", "[a-c]{2}"), GrammarSpec("choice", ["a", "b"]),
                 GrammarSpec("ebnf", 'root ::= "x"')):
        assert engine.grammar.backend_of(spec) == "xgrammar"
        assert engine.grammar.matcher(spec).backend == "xgrammar"
    assert engine.grammar.backend_of(GrammarSpec("lark", 'start: "x"')) == "llguidance"


def test_strict_on_llguidance_allows_no_extra_properties(engine):
    from replicas.grammar import GrammarSpec
    schema = {"type": "object", "properties": {"v": {"type": "integer", "multipleOf": 2}}, "required": ["v"]}
    assert _accepts(engine.grammar.matcher(GrammarSpec("json_schema", schema)), engine.tokenizer, '{"v": 2, "w": 1}')
    strict = GrammarSpec("json_schema", schema, strict=True)
    assert not _accepts(engine.grammar.matcher(strict), engine.tokenizer, '{"v": 2, "w": 1}')
    assert _accepts(engine.grammar.matcher(strict), engine.tokenizer, '{"v": 2}')


@pytest.mark.parametrize("backend_schema", [SCHEMA_XGR, {**SCHEMA, "properties": {**SCHEMA["properties"],
                                                                                 "days": {"type": "integer", "multipleOf": 3}}}])
def test_matcher_interface_rollback_and_jump_forward(engine, backend_schema):
    """Both backends: a refused token leaves the state as it was, rollback undoes accepted tokens
    (EOS included), the jump-forward string is the forced text."""
    from replicas.grammar import GrammarSpec
    m = engine.grammar.matcher(GrammarSpec("json_schema", backend_schema))
    tok = engine.tokenizer
    assert m.find_jump_forward_string().startswith('{"city": "')
    ids = tok('{"city": "Paris", "days": 3, "unit": "c"}', add_special_tokens=False)["input_ids"]
    assert not m.accept_token(tok('7', add_special_tokens=False)["input_ids"][0])  # not valid first
    assert all(m.accept_token(t) for t in ids) and m.accept_token(tok.eos_token_id) and m.is_terminated()
    m.rollback(1)   # the EOS
    assert not m.is_terminated()
    m.rollback(len(ids))
    assert m.find_jump_forward_string().startswith('{"city": "')
    assert all(m.accept_token(t) for t in ids) and m.accept_token(tok.eos_token_id)


def test_mixed_batch_mask_one_buffer(engine):
    """One batch, rows on xgrammar, llguidance and none: each row's mask is its own matcher's."""
    import torch

    from replicas.grammar import GrammarSpec
    specs = [GrammarSpec("json_schema", {"type": "boolean"}), None,
             GrammarSpec("json_schema", {"type": "integer", "multipleOf": 2}), GrammarSpec("choice", ["yes", "no"]),
             GrammarSpec("lark", 'start: "maybe"')]
    matchers = [engine.grammar.matcher(s) if s else None for s in specs]
    assert [m.backend if m else None for m in matchers] == ["xgrammar", None, "llguidance", "xgrammar", "llguidance"]
    vocab = engine.model.config.vocab_size
    logits = torch.zeros(len(specs), vocab)
    engine.grammar.apply_bitmask(logits, matchers)
    tok = engine.tokenizer

    def allowed(r):
        return {tok.decode([t]) for t in torch.nonzero(logits[r] == 0).flatten().tolist()}
    assert allowed(0) and all("true".startswith(a) or "false".startswith(a) for a in allowed(0))
    assert (logits[1] == 0).all()
    assert allowed(2) and all(a and (a.isdigit() or a == "-") for a in allowed(2)), allowed(2)
    assert allowed(3) and all("yes".startswith(a) or "no".startswith(a) for a in allowed(3))
    assert allowed(4) and all("maybe".startswith(a) for a in allowed(4))
    for r, m in enumerate(matchers):   # the same as each alone
        if m is not None:
            alone = torch.zeros(1, vocab)
            engine.grammar.apply_bitmask(alone, [m])
            assert torch.equal(alone[0], logits[r])


def test_engine_batch_mixing_backends_validates(engine, chat_prompts):
    """The engine decodes one batch whose requests use both backends; every output validates."""
    schemas = [SCHEMA_XGR, {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 5, "minimum": 0,
                                                                 "maximum": 100}}, "required": ["n"],
                        "additionalProperties": False}]
    outs = engine.generate(chat_prompts[:2], SamplingParams(max_tokens=48, temperature=1.0, seed=3),
                           [GrammarSpec("json_schema", s) for s in schemas])
    assert [engine.grammar.backend_of(GrammarSpec("json_schema", s)) for s in schemas] == ["xgrammar", "llguidance"]
    for out, schema in zip(outs, schemas):
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), schema)
        else:
            assert out.text.startswith("{")


def test_tools_lark_accepts_what_the_structural_tag_accepts(engine):
    """The llguidance tool grammar (tools_lark) against xgrammar's structural tag, on a schema
    both enforce: the same strings accepted for each tool_choice and parallel_tool_calls."""
    from replicas.grammar import GrammarSpec, LLGuidanceMatcher, _llguidance_compile
    tools = [{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}} for n in ("f", "g")]
    call = '<tool_call>\n{"name": "%s", "arguments": {"x": 1}}\n</tool_call>'
    texts = [call % "f", call % "g", call % "g" + "\n" + call % "g", "hi " + call % "f", call % "f" + "\n" + call % "g", call % "g" + " bye", "hello", "",
             "a <tool_call> b", call % "h", '<tool_call>\n{"name": "f", "arguments": {"x": "1"}}\n</tool_call>']
    for choice in ("auto", "required", {"type": "function", "function": {"name": "g"}}):
        for parallel in (True, False):
            spec = GrammarSpec("tools", {"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel})
            compiled = _llguidance_compile(*engine.grammar.llg, spec)
            xgr = [_accepts(engine.grammar.matcher(spec), engine.tokenizer, t) for t in texts]
            llg = [_accepts(LLGuidanceMatcher(compiled), engine.tokenizer, t) for t in texts]
            assert llg == xgr, (choice, parallel, xgr, llg)
            assert any(xgr)


def test_keywords_inside_values_are_not_schema(engine):
    from replicas.grammar import unenforced_keywords
    schema = {"type": "object", "properties": {"not": {"type": "string"}, "k": {"enum": [{"not": 1}]},
                                               "u": {"type": "array", "uniqueItems": False}}}
    assert unenforced_keywords(schema) == []
    for fine in ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, {"oneOf": [{"const": "a"}, {"enum": ["b"]}]},
                 {"type": "number", "enum": [1, 2.5]}, {"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s"},
                 {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                 {"type": "string", "pattern": "^[a-z]+(\\.[a-z]+)*$"}, {"type": "string", "pattern": "^v(ab)?$"}):
        assert unenforced_keywords(fine) == [], fine


def test_strict_schema_allows_no_extra_properties(engine):
    from replicas.grammar import GrammarSpec
    schema = {"type": "object", "properties": {"v": {"type": "integer"}}, "required": ["v"]}
    loose = engine.grammar.matcher(GrammarSpec("json_schema", schema))
    strict = engine.grammar.matcher(GrammarSpec("json_schema", schema, strict=True))
    text = '{"v": 1, "w": 2}'
    assert loose.accept_string(text)
    assert not strict.accept_string(text)


def test_compiler_process_is_replaced_after_a_timeout_or_a_death(engine):
    """Isolation: a compilation past the time bound, or a compiler that dies mid-compilation, costs
    that request a GrammarCompileError; the next grammar compiles in a fresh process."""
    import os
    import signal

    from replicas.errors import GrammarCompileError
    from replicas.grammar import GrammarCompiler, GrammarSpec
    c = GrammarCompiler(engine.tokenizer, engine.model.config.vocab_size, timeout_s=0.5)
    try:
        c.compile(GrammarSpec("regex", "a+"))  # the first call may wait for the process to start
        first = c._proc.pid
        os.kill(first, signal.SIGSTOP)  # a compiler that hangs
        with pytest.raises(GrammarCompileError, match="did not compile within"):
            c.compile(GrammarSpec("json_schema", {"type": "object"}))
        assert c._proc is None  # killed
        c.compile(GrammarSpec("regex", "b+"))
        assert c._proc.pid != first
        send = c._conn.send

        def send_then_die(spec):  # the compiler dies holding the request, before it answers
            os.kill(c._proc.pid, signal.SIGSTOP)
            send(spec)
            os.kill(c._proc.pid, signal.SIGKILL)
            c._proc.join()
        c._conn.send = send_then_die
        with pytest.raises(GrammarCompileError, match="died"):
            c.compile(GrammarSpec("regex", "c+"))
        assert c.compile(GrammarSpec("regex", "d+")) is not None
    finally:
        c.close()


def test_compiled_grammar_cache_is_bounded(engine):
    from replicas.grammar import GrammarCompiler, GrammarSpec
    c = GrammarCompiler(engine.tokenizer, engine.model.config.vocab_size, isolate=False, cache_bytes=20_000)
    for i in range(30):
        c.compile(GrammarSpec("regex", f"x{i}[a-z]+"))
    assert 0 < c._cached_bytes <= 20_000 and len(c._cache) < 30
    assert c.compile(GrammarSpec("regex", "x29[a-z]+")) is c._cache["regex:" + '"x29[a-z]+"'][0]


def test_isolated_cache_counts_grammars_by_their_serialized_size(engine):
    """xgrammar's memory_size_bytes under-reports a deserialized grammar 20-60x: the cache counts
    the serialized size, so that its bound is a bound on the process's memory."""
    import json as _json

    from replicas.grammar import GrammarCompiler, GrammarSpec
    c = GrammarCompiler(engine.tokenizer, engine.model.config.vocab_size, cache_bytes=64 << 20)
    try:
        schema = {"type": "object", "properties": {f"k{i}": {"type": "integer", "minimum": 0, "maximum": 99999}
                                                   for i in range(6)},
                  "required": ["k0"]}
        g = c.compile(GrammarSpec("json_schema", schema))
        (_, size), = c._cache.values()
        again = g.serialize_json()  # what the size counts (the compiler process's copy: within bytes)
        assert size == c._cached_bytes and abs(size - len(again)) < size / 100 and _json.loads(again)
        assert size > g.memory_size_bytes
    finally:
        c.close()


def test_optional_group_detector():
    from replicas.grammar import optional_group_starting_optional as f
    assert f(r"^v(x*j)?$") and f(r"^(a|b*c)*$") and f(r"^(\d{0,3}x)?$") and f(r"^v(?:\s*\+(json))?$")
    assert not any(f(p) for p in (r"^v(ab)?$", r"^vx*j$", r"^v(x*j)$", r"^(\d{1,3}x)?$", r"^([(]x*)?$",
                                  r"^(?:[a-z\d][\w!#$&^.-]+)+$"))


def test_optional_group_with_repeated_end_detector():
    from replicas.grammar import optional_group_with_repeated_end as f
    assert all(f(p) for p in (r"^(ab*)?c$", r"^([ZB][1-9][0-9]*)?K[1-9][0-9]*$", r"^(a|b[0-9]*)?K$", r"^(ab{2,})?c$",
                              r"^x(a+b)?$", r"^-?P([0-9]+Y)?([0-9]+M)?([0-9]+D)?(T([0-9]+H)?([0-9]+M)?([0-9]+S)?)?$"))
    assert all(f(p) for p in (r"^a(x0{1,2})?$", r"^a(x0{0,2})?$", r"^a(x0{2,})?$", r"^a(x(0{1,2}))?$",
                              r"^a(x(?:0{1,2})?)?$", r"^a(x0{1,3}?)?$", r"^a(x0{1,2}|a)?$", r"^a(x0{1,2})??$",
                              r"^1(\+a(\.a)*)?$"))
    assert not any(f(p) for p in (r"^(a[0-9]*b)?c$", r"^(ab{2})?c$", r"^x(ab*)*c$", r"^(\d{1,3}x)?$", r"^(ab)?c$",
                                  r"^x(a+b)*$", r"^a(x0?)?$", r"^a(x0{0,1})?$", r"^a(x0{1,2}a)?$", r"^a(x\{1,2\})?$",
                                  r"^a(x0{1,2})+$"))


def test_alternation_with_bounded_repeat_detector():
    from replicas.grammar import alternation_with_bounded_repeat as f
    assert all(f(p) for p in (r"^(0{1,2}|0)$", r"0{1,2}|0", r"^(a|0{1,2}|0)$", r"^(00{0,1}|0)$", r"^x(a|(b{2,3}))$"))
    assert not any(f(p) for p in (r"^0{1,2}$", r"^(0{2}|0)$", r"^(0+|0)$", r"^(a|b)0{1,2}$", r"^(a|\{1,2\})$"))


def test_pattern_optional_group_really_breaks_in_xgrammar(engine):
    """Keeps the refusal honest: if a later xgrammar accepts only matching strings, this fails and
    the refusal can go."""
    import json as _json

    import xgrammar as xgr
    c = xgr.GrammarCompiler(engine.grammar.info)
    m = xgr.GrammarMatcher(c.compile_json_schema(_json.dumps({"type": "string", "pattern": "^v(x*j)?$"}),
                                                 any_whitespace=False))
    assert m.accept_string('"vx"') and (m.is_terminated() or m.accept_token(engine.tokenizer.eos_token_id))
    for pattern, text in (("^a(x0{1,2})?$", '"a0"'), ("^1(\\+a(\\.a)*)?$", '"1.a"'),   # (not matches)
                          ("^(0{1,2}|0)$", '"0000"')):
        m = xgr.GrammarMatcher(c.compile_json_schema(_json.dumps({"type": "string", "pattern": pattern}),
                                                     any_whitespace=False))
        assert m.accept_string(text) and (m.is_terminated() or m.accept_token(engine.tokenizer.eos_token_id)), pattern


def test_pattern_whitespace_is_ecma_262s_on_both_backends(engine):
    """JSON Schema's ``\\s`` is ECMA-262's: U+FEFF and U+00A0 match, U+0085 does not (llguidance's
    own ``\\s`` is Unicode White_Space: a grammar sample ending in U+0085 broke ``^\\s*...\\s*$``).
    Raw characters, as the model writes them."""
    from replicas.grammar import GrammarSpec
    spec = GrammarSpec("json_schema", {"type": "string", "pattern": "^\\s*a\\S$"})
    assert engine.grammar.backend_of(spec) == "llguidance"   # (xgrammar's \\s is ECMA's already)
    for text, ok in (('"\ufeffab"', True), ('"\u00a0 \u2028ab"', True), ('"ab"', True), ('"\u0085ab"', False),
                     ('"a\u00a0"', False), ('"a\ufeff"', False)):
        assert _accepts(engine.grammar.matcher(spec), engine.tokenizer, text) == ok, text


def test_ecma_whitespace_rewrite():
    from replicas.grammar import _ECMA_SPACE, ecma_whitespace as f
    assert f(r"^\s+x\S$") == f"^[{_ECMA_SPACE}]+x[^{_ECMA_SPACE}]$"
    assert f(r"[\s\d]") == f"[{_ECMA_SPACE}\\d]" and f(r"\\s") == r"\\s" and f(r"[]\s]") == f"[]{_ECMA_SPACE}]"
    assert f(r"[\S]") == f"[^{_ECMA_SPACE}]" and f(r"[a\S]") == f"(?:[a]|[^{_ECMA_SPACE}])"
    with pytest.raises(ValueError, match="inside a negated character class"):
        f(r"[^\S]")
    import re   # the rewrite means the same as ECMA-262 on characters both agree on
    for p, x in ((r"^[a\S]+$", "ab"), (r"^[a\S]+$", "a b"), (r"^\S[\s,]$", "x,"), (r"^\S[\s,]$", "x\ufeff")):
        assert bool(re.search(f(p), x)) == (x not in ("a b",)), (p, x)


def test_llguidance_matcher_accepts_many_values_of_a_counted_pattern(engine):
    """Github_hard #102's word-count pattern beside a length bound, 400 varied valid values in a
    row, each through a new matcher of the one compiled grammar, token by token (as drafts and
    forced strings are accepted, with no mask computed by a step). Checking tokens on states
    whose mask was never computed sent llguidance's lexer building regex derivatives until it gave
    up: the first value was refused at its 44th token and every later matcher at its first (all
    400 here), while the same values were accepted with a mask computed at every step."""
    import random

    from replicas.grammar import GrammarSpec
    schema = {"type": "string", "pattern": "^(?:\\S+\\s+){0,29}\\S+$", "maxLength": 300}
    spec = GrammarSpec("json_schema", schema)
    assert engine.grammar.backend_of(spec) == "llguidance"
    validator = jsonschema.Draft7Validator(schema)
    rng = random.Random(0)

    def word():
        return "".join(chr(rng.choice([rng.randrange(33, 127), rng.randrange(0xa1, 0x2000), rng.randrange(0x4e00, 0x9fff)]))
                       for _ in range(rng.randrange(1, 12)))
    values = []
    while len(values) < 400:
        text = word()
        for _ in range(rng.randrange(0, 29)):
            text += "".join(rng.choice([" ", "\u3000", "\t", "\n"]) for _ in range(rng.randrange(1, 3))) + word()
        text = text[:300].rstrip()
        if text and validator.is_valid(text) and "\x7f" not in text:   # (llguidance takes DEL escaped only)
            values.append(text)
    rejected = [i for i, v in enumerate(values)
                if not _accepts(engine.grammar.matcher(spec), engine.tokenizer, json.dumps(v, ensure_ascii=False))]
    assert not rejected, f"{len(rejected)} of {len(values)} rejected, the first: {values[rejected[0]]!r}"
    m = engine.grammar.matcher(spec)      # a forced string is checked the same way
    assert m.accept_string(json.dumps(values[0], ensure_ascii=False)[:-1]) and not m.accept_string("\x01")


def test_routing_reads_a_format_that_is_not_a_string():
    """A ``format`` whose value is an object (a property named "format" in a node without
    ``properties``, as some JSONSchemaBench schemas have) is no keyword to route on: no error."""
    from replicas.grammar import unenforced_keywords
    assert unenforced_keywords({"type": "object", "properties": {"a": {"format": {"type": "string"}}}}) == []
    assert unenforced_keywords({"properties": {"a": {"format": "uuid"}}}) == ["format without type at $.properties.a"]
    assert unenforced_keywords({"properties": {"a": {"format": "x-custom"}}}) == []   # an annotation


@pytest.mark.parametrize("pattern,bad,good", [
    ("^[[a-z]*[-]?[a-z]*]*$", ["a*", "a?"], ["[", "a-b]", "ab"]),   # Rust read "[[" as a nested class
    ("^[a&&b]$", ["c"], ["a", "&", "b"]),                                # and "&&" as intersection
    ('^[a"--x]+$', ["y", "!"], ["&", "x", "a-"]),                          # and "--" as difference
    ("^.+\\<.+@.+\\..+\\>$", ["x a@b.c y"], ["x <a@b.c>"]),            # "\<" a word boundary
    ("^(?!@@)[@a-z]+$", ["@@a"], ["@a", "a@@"]),                        # look-ahead after ^ (refused before)
    ("^(\\/?((\\.{2})|([a-z0-9\\-]*))($|\\/))*$", ["A", "..."], ["a/b", "../x", ""]),   # "$" inside
])
def test_patterns_read_as_python_and_ecma_do(engine, pattern, bad, good):
    """Patterns whose syntax llguidance's regex engine (Rust's) reads otherwise, or refuses: each
    string through the matcher agrees with Python's ``re`` (what ``jsonschema`` uses)."""
    import re

    from bench.grammar_soundness import Grammar
    schema = {"type": "object", "properties": {"p": {"type": "string", "pattern": pattern, "maxLength": 40}},
              "required": ["p"]}
    g = Grammar(engine.grammar, engine.tokenizer, schema)
    assert g.backend == "llguidance"
    for s in bad:
        assert not re.search(pattern, s) and g.guided({"p": s}) is None, s
    for s in good:
        assert re.search(pattern, s) and g.guided({"p": s}) is not None, s


def test_schemas_differing_only_in_property_order_are_two_grammars(engine):
    """Both backends write properties in the schema's order, so the compile cache keeps key
    order: a schema that lists the same properties in the other order got, from a sorted cache
    key, the first one's grammar and so the first one's order."""
    from replicas.grammar import GrammarCompiler, GrammarSpec
    c = GrammarCompiler(engine.tokenizer, engine.model.config.vocab_size, isolate=False)
    integer = {"type": "integer"}
    for names in (["a", "b"], ["b", "a"]):
        schema = {"type": "object", "properties": {n: integer for n in names}, "required": ["a", "b"],
                  "additionalProperties": False}
        spec = GrammarSpec("json_schema", schema)
        c.compile(spec)
        ordered = "{" + ", ".join(f'"{n}": 1' for n in names) + "}"
        reverse = "{" + ", ".join(f'"{n}": 1' for n in reversed(names)) + "}"
        assert _accepts(c.matcher(spec), engine.tokenizer, ordered), names
        assert not _accepts(c.matcher(spec), engine.tokenizer, reverse), names
