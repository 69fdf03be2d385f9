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


@pytest.mark.parametrize("schema,needle", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems at $"),
    ({"type": "array", "contains": {"const": 3}}, "contains at $"),
    ({"type": "integer", "not": {"const": 0}}, "not at $"),
    ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "allOf at $"),
    ({"type": "object", "properties": {"b": {"type": "string", "pattern": "^a+$", "maxLength": 4}}},
     "pattern with minLength / maxLength at $.properties.b"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if at $"),
    # Found by a new-user trial: each produced schema-breaking output under the grammar.
    ({"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["b"]}, "required b not in properties"),
    ({"type": "object", "properties": {"a": {"type": "boolean"}}, "anyOf": [{"required": ["a"]}]},
     "anyOf beside type, properties"),
    ({"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "enum": ["x"]}, "$ref beside enum"),
    ({"type": "string", "enum": ["a", 1]}, "outside type string"),
    ({"type": "integer", "const": "a"}, "outside type integer"),
    ({"oneOf": [{"type": "number"}, {"type": "integer", "minimum": 3}]}, "oneOf with members that may overlap"),
    ({"$ref": "http://example.com/x.json"}, "not a local JSON pointer"),
    # JSONSchemaBench Github_trivial #243 over HTTP: "video/s_data " came out for a MIME pattern.
    ({"type": "string", "pattern": "^v(?:\\s*\\+json)?$"}, "optional group that starts with an optional atom"),
])
def test_unenforceable_keywords_are_refused(engine, schema, needle):
    """xgrammar 0.2.9 compiles these but lets output break them: refused with where they are."""
    from replicas.errors import GrammarCompileError
    from replicas.grammar import GrammarSpec, unenforced_keywords
    assert any(needle in x for x in unenforced_keywords(schema))
    with pytest.raises(GrammarCompileError, match="cannot enforce"):
        engine.grammar.compile(GrammarSpec("json_schema", schema))
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": schema}}}}
    with pytest.raises(GrammarCompileError, match="tool 'f' uses"):
        engine.grammar.compile(GrammarSpec("tools", {"tools": [tool]}))


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
        schema = {"type": "object", "properties": {f"k{i}": {"type": "string", "maxLength": 8} for i in range(6)},
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


def test_pattern_optional_group_really_breaks_in_xgrammar(engine):
    """Keeps the refusal honest: if a later xgrammar accepts only matching strings, this fails and
    the refusal can go."""
    import json as _json

    import xgrammar as xgr
    c = xgr.GrammarCompiler(engine.grammar.info)
    m = xgr.GrammarMatcher(c.compile_json_schema(_json.dumps({"type": "string", "pattern": "^v(x*j)?$"}),
                                                 any_whitespace=False))
    assert m.accept_string('"vx"') and (m.is_terminated() or m.accept_token(engine.tokenizer.eos_token_id))
