"""Property names checked on the text (``replicas/name_checks.py``): a name spelled with an escape,
or written twice in one object, is refused by the server's matcher, on both backends; the step's
mask never offers such a token and always leaves the others."""

import json

import jsonschema
import pytest
import torch

from replicas.grammar import GrammarSpec
from replicas.name_checks import _Names
from tests.replicas.test_grammar import _accepts

# Found at stop 42 by probing texts a model could write: each was accepted before (the backend
# named), each is invalid once decoded.
ESCAPED_OR_REPEATED_NAMES = [
    # "\u0061" is "a": checked against additionalProperties (xgrammar) instead of a's schema
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}},
     '{"\\u0061": "x"}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"\\u0061": "x"}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, '{"a": 1, "\\u0061": "x"}'),
    # llguidance: a name matching the pattern once decoded, taken as additional
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "additionalProperties": {"type": "string"}},
     '{"\\u0078y": "s"}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 3}},
      "additionalProperties": {"type": "boolean"}}, '{"\\u0062": true}'),
    # xgrammar counts minProperties on the text: one name twice is one property
    ({"type": "object", "minProperties": 2}, '{"a": 1, "a": 2}'),
]


@pytest.mark.parametrize("schema,text", ESCAPED_OR_REPEATED_NAMES)
def test_escaped_or_repeated_property_names_are_refused(engine, schema, text):
    assert not jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))
    spec = GrammarSpec("json_schema", schema)
    assert not _accepts(engine.grammar.matcher(spec), engine.tokenizer, text)


def test_names_written_once_and_escapes_in_values_still_pass(engine):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}}
    spec = GrammarSpec("json_schema", schema)
    for text in ('{"a": 1, "b": "\\u0061\\/", "a\\"b": "x", "c\\n": "y"}', '{"b": "x", "c": "y"}',
                 '{"a": 1, "o": "{\\"a\\": 1, \\"a\\": 2}"}'):
        assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))
        assert _accepts(engine.grammar.matcher(spec), engine.tokenizer, text), text
    nested = {"type": "array", "items": {"type": "object"}}
    assert _accepts(engine.grammar.matcher(GrammarSpec("json_schema", nested)), engine.tokenizer,
                    '[{"a": 1}, {"a": 2, "b": {"a": 3}}]')   # the same name in other objects


@pytest.mark.parametrize("text,ok", [
    ('{"a": 1, "b": {"a": 2}}', True), ('{"\\u0061": 1}', False), ('{"a": "\\u0061"}', True),
    ('{"a": 1, "a": 2}', False), ('[{"a": 1}, {"a": 1}]', True), ('{"a\\/b": 1}', False),
    ('{"a\\"": 1, "a\\"": 2}', False), ('{"x": ["a", "a"], "y": "\\/"}', True), ('{"a": {}, "b": [], "a": 0}', False),
    # a control character without a short escape: \u00XX, lowercase (as json.dumps writes it), once
    ('{"\\u0001": 1, "\\u001b": 2}', True), ('{"\\u000a": 1}', False), ('{"\\u001B": 1}', False),
    ('{"\\u001b": 1, "\\u001b": 2}', False), ('{"\\u0100": 1}', False), ('{"\\u007f": 1}', True),
    ('{"\x7f": 1}', False), ('{"a": "\x7f"}', True),
])
def test_scan(text, ok):
    assert _Names().feed(text.encode()) is ok


def _allowed(engine, matcher) -> list[int]:
    logits = torch.zeros(1, engine.grammar.vocab_size)
    engine.grammar.apply_bitmask(logits, [matcher])
    return (logits[0] > float("-inf")).nonzero().flatten().tolist()


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "integer"}},   # xgrammar
    {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "integer"},
     "patternProperties": {"^z": {"type": "integer"}}},                                                          # llguidance
])
@pytest.mark.parametrize("prefix", ['{"a": 1, "', '{"bb": 1, "bb', '{"a": 1, "c\\', '{"a": 1, "c\\u00', '{"a": 1, "bb": 2, '])
def test_masks_leave_out_refused_tokens_and_keep_the_rest(engine, schema, prefix):
    """After ``prefix``, every token the step's mask allows is accepted by the matcher (the check
    leaves the grammar's other tokens), and none that writes an escape in the name or closes a
    name already written is allowed."""
    tokenizer, tables = engine.tokenizer, None
    matcher = engine.grammar.matcher(GrammarSpec("json_schema", schema))
    for t in tokenizer(prefix, add_special_tokens=False)["input_ids"]:
        assert matcher.accept_token(t)
    tables = matcher._tables
    allowed = _allowed(engine, matcher)
    assert allowed
    text = matcher._text
    for t in allowed:
        data = tables.token_bytes[t]
        assert _Names().feed(text + data) or t in engine.grammar.info.stop_token_ids, (prefix, data)
        assert matcher.accept_token(t), (prefix, data)
        matcher.rollback(1)
    refused = [t for t in range(len(tables.token_bytes)) if not _Names().feed(text + tables.token_bytes[t])]
    if prefix.endswith(('"bb', '\\', 'u00')):
        assert refused   # (this vocabulary has such tokens: the mask had something to leave out)
    assert not set(refused) & set(allowed)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"type": "integer"}}},                                   # xgrammar
    {"type": "object", "properties": {"a": {"type": "integer"}}, "patternProperties": {"^z": {}}},   # llguidance
])
def test_tool_arguments_names_checked_inside_calls_only(engine, schema):
    """Tool calls: the same check on each call's JSON; the free text around calls (quotes,
    escapes, braces) is not scanned."""
    tools = {"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}], "tool_choice": "auto"}
    spec = GrammarSpec("tools", tools)
    call = '<tool_call>\n{"name": "f", "arguments": %s}\n</tool_call>'
    bad = call % '{"\\u0061": "x"}'
    assert not jsonschema.Draft202012Validator(schema).is_valid({"a": "x"})
    assert not _accepts(engine.grammar.matcher(spec), engine.tokenizer, bad)
    assert not _accepts(engine.grammar.matcher(spec), engine.tokenizer, call % '{"b": 1, "b": 2}')
    for good in ('He said "\\u0061" {"a": 1, "a": 2}.\n' + call % '{"a": 2}',
                 call % '{"a": 1}' + "\n" + call % '{"a": 1}'):   # (the same names in two calls)
        assert _accepts(engine.grammar.matcher_of(engine.grammar.compile(spec)), engine.tokenizer, good)
        assert _accepts(engine.grammar.matcher(spec), engine.tokenizer, good), good


def test_closed_object_of_finite_pattern_names_never_reaches_a_dead_end(engine):
    """JSONSchemaBench Github_easy #1551: with ``^line[1-3]$`` left as a pattern, once every line
    was written the grammar still allowed ``, "line3``, the name check refused its closing quote and
    only EOS was left (output cut mid-object). Written as declared names, each is written once and
    the object can always close."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "patternProperties": {"^line[1-3]$": {"type": "string"}}, "additionalProperties": False,
              "required": ["city", "line1"]}
    spec = GrammarSpec("json_schema", schema)
    matcher = engine.grammar.matcher(spec)
    prefix = '{"city": "a", "line1": "x", "line2": "y", "line3": "z"'
    for t in engine.tokenizer(prefix, add_special_tokens=False)["input_ids"]:
        assert matcher.accept_token(t)
    assert not matcher.accept_string(', "line')      # no name is left to write
    assert _accepts(engine.grammar.matcher(spec), engine.tokenizer, prefix + "}")
    assert _accepts(engine.grammar.matcher(spec), engine.tokenizer, '{"city": "a", "line1": "x", "line3": "z"}')
