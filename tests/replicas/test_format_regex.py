"""``format: regex`` served with a regular subset of the expressions Python compiles
(replicas/format_regex.py): what the pattern accepts compiles, and the whole path (schema in,
llguidance matcher) takes common expressions and refuses broken ones."""

import json
import random
import re

import jsonschema
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replicas.format_regex import REGEX_PATTERN
from replicas.grammar import GrammarSpec

COMMON = [r"^[a-z]+$", r"^\d{3}-\d{4}$", r"^(?:[a-zA-Z0-9_.-]+)@example\.com$", r"(?i)abc", r"^[\w.-]+$",
          r"^[a-f0-9]{8}(-[a-f0-9]{4}){3}-[a-f0-9]{12}$", r"^v?[0-9]+(\.[0-9]+)*$", r"[^/]+", r"^.*\.js$",
          r"^[-a-z]+$", r"\bword\b", r"", r"a|", r"(?!x)y", r"a*?b{2,}c{,3}"]
BROKEN = ["(", "a**", "[z-a]", "*a", "a{3,1}", "\\", "(?x) ?", "\\q", "[", "^*", "\\b+"]


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.from_regex(REGEX_PATTERN, fullmatch=True))
def test_what_the_pattern_accepts_compiles(text):
    re.compile(text)


def test_common_expressions_in_broken_ones_out():
    for text in COMMON:
        assert re.fullmatch(REGEX_PATTERN, text), text
    for text in BROKEN:
        try:
            re.compile(text)
            compiles = True
        except re.error:
            compiles = False
        assert not compiles and not re.fullmatch(REGEX_PATTERN, text), text


def test_format_regex_through_the_whole_path(engine):
    from bench.grammar_soundness import Grammar
    schema = {"type": "object", "properties": {"p": {"type": "string", "format": "regex"}}, "required": ["p"]}
    cls = jsonschema.validators.validator_for(schema)
    v = cls(schema, format_checker=cls.FORMAT_CHECKER)
    g = Grammar(engine.grammar, engine.tokenizer, schema)
    assert g.backend == "llguidance"
    for text in COMMON:
        assert g.guided({"p": text}) is not None, text
    for text in BROKEN:
        assert not v.is_valid({"p": text}) and g.guided({"p": text}) is None, text
    rng = random.Random(0)
    for _ in range(5):
        out = g.sample(rng)
        assert out is None or v.is_valid(json.loads(out)), out
    engine.grammar.compile(GrammarSpec("json_schema", schema))
