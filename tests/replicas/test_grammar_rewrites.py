"""``not``, ``if`` / ``then`` / ``else``, ``uniqueItems`` and ``propertyNames`` served exactly
(replicas/schema_not.py, replicas/schema_collections.py): for each idiom seen in
JSONSchemaBench, instances jsonschema accepts are accepted through the whole path (schema in,
llguidance matcher, text token by token, then EOS) and instances it rejects are rejected in every
key order; where a rewrite cannot be written exactly the schema stays refused, naming the keyword
and where."""

import json
import random

import jsonschema
import pytest

from replicas.errors import GrammarCompileError
from replicas.grammar import GrammarSpec

INT, STR = {"type": "integer"}, {"type": "string"}

# (idiom, schema, valid instances, invalid instances)
IDIOMS = [
    ("not required: two names never together",
     {"type": "object", "properties": {"result": INT, "error": STR}, "not": {"required": ["result", "error"]}},
     [{"result": 1}, {"error": "e"}, {}], [{"result": 1, "error": "e"}]),
    ("not required, no type: a non-object meets required, so fails its not",
     {"properties": {"a": INT}, "not": {"required": ["a"]}},
     [{}, {"b": 1}], [{"a": 1}, "s", 3]),
    ("not {}: a property that must be absent",
     {"type": "object", "properties": {"version": {"not": {}}, "n": INT}},
     [{"n": 1}, {}], [{"version": 1}, {"version": None, "n": 1}]),
    ("not enum beside type",
     {"type": "string", "not": {"enum": ["intramural", "x"]}},
     ["y", "intramuralx", ""], ["intramural", "x"]),
    ("not const of an integer (no other values listed)",
     {"type": "integer", "not": {"enum": [0]}},
     [1, -3], [0]),
    ("not enum of numbers beside type number: the intervals between them",
     {"type": "number", "not": {"enum": [1, 2.5]}},
     [0, 1.5, 3, 2.25], [1, 2.5, 1.0]),
    ("not type",
     {"not": {"type": ["array", "object", "null"]}},
     ["a", 1, True], [[1], {}, None]),
    ("not anyOf of required: allOf of the negations",
     {"type": "object", "properties": {"d": INT, "x": INT, "y": INT},
      "not": {"anyOf": [{"required": ["d", "x"]}, {"required": ["d", "y"]}]}},
     [{"d": 1}, {"x": 1, "y": 2}], [{"d": 1, "x": 2}, {"d": 1, "y": 2}]),
    ("not allOf of required",
     {"type": "object", "properties": {"cmd": STR, "args": STR}, "not": {"allOf": [{"required": ["cmd"]}, {"required": ["args"]}]}},
     [{"cmd": "a"}, {"args": "b"}], [{"cmd": "a", "args": "b"}]),
    ("not properties with a const",
     {"type": "object", "properties": {"k": STR}, "required": ["k"], "not": {"properties": {"k": {"const": "bad"}}}},
     [{"k": "good"}], [{"k": "bad"}]),
    ("not not",
     {"type": "integer", "not": {"not": {"minimum": 3}}},
     [3, 7], [2]),
    ("not pattern of one character class (searched)",
     {"type": "string", "not": {"pattern": "[^a-zA-Z0-9.,()@&' -]"}},
     ["Ab c.", ""], ["a!b", "x\n"]),
    ("not pattern of a whole string of one class, with \\s",
     {"type": "string", "not": {"pattern": "^[\\.\\,\\*\\\\\\-\\s\\{\\}\\(\\)]+$"}},
     ["ab", "", "a.b"], [" ", ".,*", "(\n)"]),
    ("not pattern of one escaped character in a group",
     {"type": "string", "not": {"pattern": "(\\$)"}},
     ["abc"], ["a$b"]),
    ("not pattern of anchored literals (Python's $ also matches before a final newline)",
     {"type": "string", "not": {"pattern": "^(tuple|list)$"}},
     ["tuples", "x", "", "tuple\n\n"], ["tuple", "list", "tuple\n"]),
    ("if on a oneOf of one pattern, then / else",
     {"type": "object", "properties": {"type": STR, "n": INT}, "required": ["type"],
      "if": {"properties": {"type": {"oneOf": [{"pattern": "^tuple$"}]}}}, "then": {"required": ["n"]},
      "else": {"properties": {"n": False}}},
     [{"type": "tuple", "n": 1}, {"type": "list"}], [{"type": "tuple"}, {"type": "list", "n": 1}]),
    ("if properties const then required (no else)",
     {"type": "object", "properties": {"Action": STR, "Target": STR}, "required": ["Action"],
      "if": {"properties": {"Action": {"const": "EditMap"}}}, "then": {"required": ["Target"]}},
     [{"Action": "EditMap", "Target": "t"}, {"Action": "Load"}], [{"Action": "EditMap"}]),
    ("if / then / else on an enum tag",
     {"type": "object", "properties": {"c": STR, "v": INT},
      "if": {"properties": {"c": {"enum": ["ghi"]}}}, "then": {"properties": {"v": {"minimum": 10}}},
      "else": {"properties": {"v": {"maximum": 0}}}},
     [{"c": "ghi", "v": 11}, {"c": "x", "v": -1}, {"v": 11}], [{"c": "ghi", "v": 5}, {"c": "x", "v": 5}]),
    ("if required then else",
     {"type": "object", "properties": {"auto": {"type": "object"}, "n": INT},
      "if": {"required": ["auto"]}, "then": {"properties": {"n": {"const": 1}}}, "else": {"required": ["n"]}},
     [{"auto": {}, "n": 1}, {"auto": {}}, {"n": 5}], [{"auto": {}, "n": 2}, {}]),
    ("if with type object (a non-object goes to else)",
     {"properties": {"type": STR}, "if": {"type": "object", "properties": {"type": {"const": "http"}}},
      "then": {"required": ["type"]}, "else": {"type": "object"}},
     [{"type": "http"}, {"type": "tcp"}], ["s", 1]),
    ("if alone constrains nothing",
     {"type": "integer", "if": {"minimum": 3}},
     [1, 5], ["a"]),
    ("a chain of if / then on a required tag (merged: the conditions are disjoint)",
     {"type": "object", "properties": {"p": STR, "s": {}}, "required": ["p"],
      "allOf": [{"if": {"properties": {"p": {"const": "a"}}}, "then": {"properties": {"s": INT}}},
                {"if": {"properties": {"p": {"const": "b"}}}, "then": {"properties": {"s": STR}}},
                {"if": {"properties": {"p": {"const": "c"}}}, "then": {"required": ["s"]}, "else": {"properties": {"s": {"type": ["integer", "string"]}}}}]},
     [{"p": "a", "s": 1}, {"p": "b", "s": "x"}, {"p": "c", "s": [1]}, {"p": "d", "s": 2}, {"p": "b"}],
     [{"p": "a", "s": "x"}, {"p": "b", "s": 1}, {"p": "c"}, {"p": "d", "s": [1]}, {"p": "a", "s": None}]),
    ("uniqueItems with maxItems 1",
     {"type": "array", "items": STR, "uniqueItems": True, "maxItems": 1},
     [[], ["a"]], [["a", "b"], [1]]),
    ("uniqueItems over an enum",
     {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True},
     [[], ["a"], ["c", "a", "b"]], [["a", "a"], ["a", "b", "a"], ["d"]]),
    ("uniqueItems over booleans, minItems",
     {"type": "array", "items": {"type": "boolean"}, "uniqueItems": True, "minItems": 1},
     [[True], [False, True]], [[], [True, True]]),
    ("uniqueItems over an enum in a $ref, no type",
     {"definitions": {"e": {"type": "string", "enum": ["x", "y"]}}, "items": {"$ref": "#/definitions/e"},
      "uniqueItems": True},
     [["x", "y"], "s", 1], [["y", "y"], ["z"]]),
    ("propertyNames enum: the object closed to those names",
     {"type": "object", "properties": {"a": INT, "z": INT}, "additionalProperties": STR,
      "propertyNames": {"enum": ["a", "b"]}},
     [{"a": 1, "b": "s"}, {}], [{"z": 1}, {"c": "s"}, {"b": 1}]),
    ("propertyNames enum with patternProperties",
     {"type": "object", "patternProperties": {"^x": INT}, "propertyNames": {"enum": ["xa", "y"]}},
     [{"xa": 1, "y": "s"}], [{"xa": "s"}, {"xb": 1}]),
    ("propertyNames pattern",
     {"type": "object", "properties": {"a": INT, "B": INT}, "propertyNames": {"pattern": "^[a-z]+$"}},
     [{"a": 1, "cd": "s"}, {}], [{"B": 1}, {"C": 1}, {"a": "s"}]),
    ("a property with its pattern's schema, through a circular $ref (the property entry dropped)",
     {"$defs": {"node": {"type": "object",
                         "properties": {"basic": {"description": "d", "anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
                         "patternProperties": {".*": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}}},
      "$ref": "#/$defs/node"},
     [{"basic": None, "x": {"basic": {}}}, {}], [{"basic": 1}, {"x": {"y": 2}}]),
    ("not pattern, any other shape: its complement on automata (replicas/regex_complement.py)",
     {"type": "string", "not": {"pattern": "^a.*b$"}},
     ["ba", "a", "abc", "a\nb"], ["ab", "axb", "ab\n"]),
    ("not pattern with \\d, read as widely as Python's Unicode class",
     {"type": "string", "not": {"pattern": "^\\d+$"}},
     ["a", "12a", ""], ["12", "\u0661"]),
    ("oneOf of string patterns that overlap: exactly one holds",
     {"type": "string", "oneOf": [{"pattern": "^a"}, {"pattern": "b$"}]},
     ["ax", "xb", "a"], ["ab", "xx", ""]),
    ("oneOf of objects told apart by a pattern (JSONSchemaBench's overlapping members)",
     {"type": "object", "properties": {"id": STR},
      "oneOf": [{"properties": {"id": {"pattern": "^[0-9]{3}$"}}}, {"properties": {"id": {"pattern": "^x"}}, "required": ["id"]}]},
     [{"id": "123"}, {"id": "xy"}, {}], [{"id": "abc"}]),
    ("if a property matches a pattern then ... (its else negates the pattern)",
     {"type": "object", "properties": {"s": STR, "n": INT}, "if": {"properties": {"s": {"pattern": "^x"}}},
      "then": {"required": ["n"]}, "else": {"properties": {"n": {"maximum": 0}}}},
     [{"s": "xa", "n": 5}, {"s": "ya", "n": -1}, {"s": "y"}], [{"s": "xa"}, {"s": "ya", "n": 5}, {"s": "x"}]),
    # llguidance 1.9 let a set holding every control character take any escape, \" and \\ too
    # (replicas/regex_complement.py, explicit_negated_classes)
    ("negated class leaving out a quote",
     {"type": "string", "pattern": '^[^"]+$'},
     ["ab", "a\\b", "é", "a\tb", "\n\u001f"], ['a"b', '"']),   # (control characters but U+0000 kept: stop 43)
    ("negated class leaving out a backslash",
     {"type": "string", "pattern": "^[^\\\\]+$"},
     ['a"b', "x", "\t"], ["a\\b", "\\"]),
    ("positive class of every control character and the space, written with \\x escapes",
     {"type": "string", "pattern": "^a[\\x00-\\x20]b$"},
     ["a b"], ['a"b', "a\\b"]),
    ("positive class of every control character and a backslash, written with \\u escapes",
     {"type": "string", "pattern": "^a[\\u0000-\\u001f\\\\]b$", "minLength": 3},
     ["a\\b"], ['a"b']),
    ("not pattern of a quote (a complement class of explicit ranges)",
     {"type": "string", "not": {"pattern": '"'}},
     ["ab", ""], ['a"', '"']),
    ("patternProperties key leaving out a quote",
     {"type": "object", "patternProperties": {'^[^"]+$': INT}, "additionalProperties": False},
     [{"a": 1}, {}], [{'a"': 1}, {"a": "s"}]),
    ("propertyNames type string only",
     {"type": "object", "propertyNames": {"type": "string"}, "additionalProperties": INT},
     [{"a": 1}], [{"a": "s"}]),
    ("overlapping patternProperties, one matching every name (Github_hard #300: .* beside another)",
     {"type": "object", "properties": {"xa": {"maximum": 10}},
      "patternProperties": {".*": INT, "^x": {"minimum": 3}}},
     [{"a": 1, "xy": 5}, {"xa": 5}, {}], [{"xy": 1}, {"a": "s"}, {"xa": 2}, {"xa": 11}, {"xa": 5.5}]),
    ("overlapping patternProperties split into disjoint regions",
     {"type": "object", "patternProperties": {"^a": INT, "b$": {"minimum": 0}}, "additionalProperties": False},
     [{"ab": 1, "a": -1, "b": 0.5}], [{"ab": -1}, {"ab": 0.5}, {"c": 1}]),
    ("finite patternProperties in a closed object written as declared names (Github_easy #1551)",
     {"type": "object", "properties": {"city": STR}, "patternProperties": {"^line[1-3]$": STR},
      "additionalProperties": False, "required": ["city", "line1"]},
     [{"city": "a", "line1": "x"}, {"city": "a", "line3": "z", "line1": "x", "line2": "y"}],
     [{"city": "a"}, {"city": "a", "line1": 1}, {"city": "a", "line1": "x", "line4": "w"},
      {"city": "a", "line1": "x", "line": "w"}]),
    ("finite patterns beside an infinite one and a declared name they match: every schema applies",
     {"type": "object", "properties": {"a1": {"maximum": 5}},
      "patternProperties": {"^a[0-9]$": INT, "^(a1|b)$": {"minimum": 0}, "^c[0-9]+$": STR, "1$": {"minimum": 1}},
      "additionalProperties": False},
     [{"a1": 3, "b": 2, "a2": -4, "c12": "s", "d1": 3}, {"b": 0.5}, {"a1": 5}],
     [{"a1": 6}, {"a1": 0}, {"a1": 2.5}, {"b": -1}, {"a2": "s"}, {"c1": 1}, {"d1": 0}, {"d": 1}]),
]


def _validator(schema):
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def _grammar(engine, schema):
    from bench.grammar_soundness import Grammar
    return Grammar(engine.grammar, engine.tokenizer, schema)


@pytest.mark.parametrize("idiom,schema,valid,invalid", IDIOMS, ids=[i[0] for i in IDIOMS])
def test_rewrite_is_served_exactly(engine, idiom, schema, valid, invalid):
    v = _validator(schema)
    assert all(v.is_valid(x) for x in valid) and not any(v.is_valid(x) for x in invalid)
    g = _grammar(engine, schema)
    for x in valid:
        assert g.guided(x) is not None, x          # accepted, in some key order
    for x in invalid:
        assert g.guided(x) is None, x              # rejected in every key order
    rng = random.Random(0)
    for _ in range(3):                             # what the grammar writes validates
        text = g.sample(rng)
        assert text is None or v.is_valid(json.loads(text)), text


@pytest.mark.parametrize("schema,needle", [
    ({"type": "string", "not": {"pattern": "^(?=a).*b$"}}, "not at $"),
    ({"type": "string", "oneOf": [{"pattern": "^(a)\\1"}, {"pattern": "b$"}]}, "oneOf with members that may overlap at $"),
    ({"type": "object", "properties": {"p": {"type": "number", "not": {"multipleOf": 2}}}}, "not at $.properties.p"),
    ({"type": "object", "properties": {"s": STR}, "if": {"properties": {"s": {"pattern": "^(?=x)"}}},
      "then": {"required": ["s"]}}, "if at $"),
    ({"type": "array", "items": {"type": "string", "maxLength": 5}, "uniqueItems": True}, "uniqueItems at $"),
    ({"type": "object", "properties": {"l": {"type": "array", "items": {"enum": [1, 2, 3, 4, 5, 6]},
                                             "uniqueItems": True}}}, "uniqueItems at $.properties.l"),
    ({"type": "object", "patternProperties": {"^x": INT}, "propertyNames": {"maxLength": 3}}, "propertyNames at $"),
    ({"type": "object", "patternProperties": {"^x": INT}, "propertyNames": {"pattern": "^[a-z]+$"}},
     "propertyNames at $"),
])
def test_rewrite_that_cannot_be_written_exactly_stays_refused(engine, schema, needle):
    with pytest.raises(GrammarCompileError, match="cannot enforce") as e:
        engine.grammar.compile(GrammarSpec("json_schema", schema))
    assert needle in str(e.value), str(e.value)


def test_refusal_lists_only_the_places_left(engine):
    """Of two nots, the one the rewrite wrote is not listed; the one it could not is, with where."""
    schema = {"type": "object", "properties": {"a": {"not": {}}, "b": {"type": "integer", "not": {"multipleOf": 2}}}}
    with pytest.raises(GrammarCompileError, match="cannot enforce") as e:
        engine.grammar.compile(GrammarSpec("json_schema", schema))
    assert "not at $.properties.b" in str(e.value) and "not at $.properties.a" not in str(e.value), str(e.value)


def test_refusal_names_only_keywords_left():
    """A refusal for something else (here an overlapping oneOf) does not list the ``not`` that
    was rewritten: llguidance's prose ("not supported") is not the keyword."""
    from replicas.grammar import _places
    schema = {"type": "object", "properties": {"a": {"not": {}}},
              "oneOf": [{"type": "number"}, {"type": "integer", "minimum": 3}]}
    message = "oneOf constraints are not supported. Enable 'coerce_one_of'"
    assert not any(p.startswith("not ") for p in _places(schema, message))
    assert any(p.startswith("not ") for p in _places(schema, 'Unimplemented keys: ["not"]'))


def test_complement_patterns():
    import re

    from replicas.schema_oneof import Inexpressible, _complement_pattern
    for pattern, strings in [("[^a-z ]", ["ab", "a b", "aB", "", "\n"]), ("(\\$)", ["$", "a", "a$"]),
                             ("^[\\s.]+$", ["", " ", ". \n", "a", ". a"]), ("\\d", ["1", "a", "a1", "\u0661"]),
                             ("^(a|b\\.c)$", ["a", "b.c", "a\n", "b.c\n", "", "ab", "bxc", "a\n\n", "\na"])]:
        comp = re.sub(r"\\x\{([0-9a-f]+)\}", lambda m: "\\U%08x" % int(m.group(1), 16), _complement_pattern(pattern))
        for s in strings:   # (the Rust class syntax read by Python's re)
            assert (re.search(pattern, s) is None) == (re.fullmatch(comp, s) is not None), (pattern, s)
    for pattern, strings in [("ab", ["ab", "xaby", "a", ""]), ("^a+", ["a", "ba", "aab", ""]),
                             ("^[a-z]+$", ["a", "ab\n", "a\n\n", "A", ""]), ("^a.b$", ["axb", "a\nb", "ab"]),
                             ("(?:[^a]+b)", ["b", "xb", "ab", "axxb"]), ("^(?:ab)+$", ["ab", "abab", "aba", "ab\n"]),
                             ("(?s:a.)|^x$", ["a\n", "a", "x", "x\n", "xx"])]:   # the general complement
        comp = re.sub(r"\\x\{([0-9a-f]+)\}", lambda m: "\\U%08x" % int(m.group(1), 16), _complement_pattern(pattern))
        for s in strings:
            assert (re.search(pattern, s) is None) == (re.fullmatch(comp, s) is not None), (pattern, s)
    for pattern in ["(?=a)b", "(a)\\1", "\\bx", "a^b", "(?i)a", "^[a-z]{0,61}\\.[a-z]{0,61}$"]:
        with pytest.raises(Inexpressible):   # look-around, back-reference, boundary, inner anchor, flags, too large
            _complement_pattern(pattern)


def test_if_chain_is_merged_into_one_any_of():
    from replicas.grammar import _llguidance_schema
    schema = {"type": "object", "properties": {"p": STR}, "required": ["p"],
              "allOf": [{"if": {"properties": {"p": {"const": str(i)}}}, "then": {"required": ["x%d" % i]}}
                        for i in range(12)]}
    out = _llguidance_schema(schema, False)
    assert len(out["allOf"]) == 1 and len(out["allOf"][0]["anyOf"]) == 13   # one branch per tag, one for none
