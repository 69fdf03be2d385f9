"""Fuzzing the schema -> grammar path (hypothesis): random JSON schemas and tool lists either
compile or raise GrammarCompileError within the time bound; nothing else escapes, and a compiled
grammar yields a matcher."""

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from replicas.errors import GrammarCompileError  # noqa: E402
from replicas.grammar import GrammarSpec  # noqa: E402

NAMES = st.text(alphabet="abcxyz_$#/ ", min_size=0, max_size=6)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=True),
                    st.text(max_size=8))
KEYWORDS = ["type", "properties", "items", "required", "enum", "const", "anyOf", "oneOf", "allOf", "$ref",
            "minimum", "maximum", "exclusiveMinimum", "minLength", "maxLength", "pattern", "format",
            "minItems", "maxItems", "additionalProperties", "prefixItems", "$defs", "multipleOf",
            "minProperties", "not", "uniqueItems"]
TYPES = st.sampled_from(["object", "array", "string", "integer", "number", "boolean", "null", "date", 3])


def schemas():
    leaf = st.one_of(st.fixed_dictionaries({"type": TYPES}), SCALARS,
                     st.fixed_dictionaries({"pattern": st.text(alphabet="a+*()[]\\^$|?.{}0-9", max_size=8)}),
                     st.fixed_dictionaries({"$ref": st.sampled_from(["#", "#/$defs/x", "#/nope", "http://x"])}))
    return st.recursive(leaf, lambda inner: st.one_of(
        st.dictionaries(st.sampled_from(KEYWORDS), st.one_of(inner, TYPES, SCALARS), max_size=4),
        st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(NAMES, inner, max_size=3),
                               "required": st.lists(NAMES, max_size=3)}),
        st.fixed_dictionaries({"type": st.just("array"), "items": inner,
                               "minItems": st.integers(-2, 5), "maxItems": st.integers(-2, 5)}),
        st.fixed_dictionaries({"anyOf": st.lists(inner, max_size=3)}),
        st.lists(inner, max_size=3)), max_leaves=12)


def _compile(engine, spec):
    try:
        engine.grammar.matcher(spec)
    except GrammarCompileError:
        pass  # a refusal must be this type; anything else fails the test


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=schemas())
def test_random_json_schemas_compile_or_raise_typed_error(engine, schema):
    _compile(engine, GrammarSpec("json_schema", schema))


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(params=st.lists(schemas(), min_size=1, max_size=3), choice=st.sampled_from(["auto", "required", "none"]))
def test_random_tool_lists_compile_or_raise_typed_error(engine, params, choice):
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": p}} for i, p in enumerate(params)]
    _compile(engine, GrammarSpec("tools", {"tools": tools, "tool_choice": choice}))
