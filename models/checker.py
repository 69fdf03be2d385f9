"""BFCL AST checker: our implementation of the public BFCL (v4, non-live) answer rules.

Rules (Berkeley Function-Calling Leaderboard, ``ast_checker``):

- the number of calls equals the number of ground-truth calls (irrelevance: no call at all);
- for ``parallel`` categories calls match ground truth in any order (each used once);
- per call: the function name matches; every parameter the schema marks required is present;
  no parameter outside the schema or outside the ground truth; each value has the schema's type
  (an int is accepted for a float); each value is among the allowed values, strings compared after
  BFCL's normalization (spaces and ``,./-_*^`` removed, lower case, ``'`` read as ``"``), lists and
  dicts element by element; a ground-truth parameter may be left out only when ``""`` is allowed.

Schemas may be in BFCL's dialect or JSON Schema (``models.bfcl.canonical_type`` maps both).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from models.bfcl import canonical_type

_PY_TYPES = {"string": str, "integer": int, "number": float, "boolean": bool, "array": list,
             "object": dict}


@dataclass(frozen=True)
class CheckResult:
    valid: bool
    error: str = ""


def standardize_string(text: str) -> str:
    return re.sub(r"[ ,./\-_*^]", "", text).lower().replace("'", '"')


def _function_schema(fn: dict[str, Any]) -> dict[str, Any]:
    """Accept an OpenAI tool entry, an OpenAI function, or a BFCL function definition."""
    return fn["function"] if "function" in fn and isinstance(fn["function"], dict) else fn


def _std(value: Any) -> Any:
    return standardize_string(value) if isinstance(value, str) else value


def _answer_type(options: Any) -> type | None:
    """The Python type of the first non-optional allowed value (BFCL reads a mismatch with the
    schema type as "the answer is a variable name")."""
    return next((type(o) for o in options if o != ""), None) if isinstance(options, list) else None


def _type_ok(value: Any, schema: dict[str, Any], options: list) -> tuple[bool, bool]:
    """(type is acceptable, value is compared as a variable). Nested lists: one level, as BFCL."""
    kind = canonical_type(schema.get("type"))
    if kind is None:
        return True, False
    expected, answer_type = _PY_TYPES[kind], _answer_type(options)
    is_variable = answer_type is not None and answer_type is not expected
    if type(value) is expected:
        items = schema.get("items") if kind == "array" else None
        item_kind = canonical_type(items.get("type")) if isinstance(items, dict) else None
        if item_kind is None:
            return True, is_variable
        item_type = _PY_TYPES[item_kind]
        for option in options:
            if not isinstance(option, list) or all(
                    type(v) is item_type or type(v) is _answer_type(option) for v in value):
                return True, is_variable
    if answer_type is not None and type(value) is answer_type:
        return True, True
    return False, False


def _dict_ok(value: dict, options: list) -> bool:
    for option in options:
        if option == "" or not isinstance(option, dict):
            continue
        if all(k in option and _std(v) in [_std(o) for o in option[k]] for k, v in value.items()) \
                and all(k in value or "" in allowed for k, allowed in option.items()):
            return True
    return False


def _value_ok(value: Any, schema: dict[str, Any], options: list, is_variable: bool) -> bool:
    kind = canonical_type(schema.get("type"))
    if not is_variable:
        items = schema.get("items") or {}
        if kind == "object":
            return _dict_ok(value, options)
        if kind == "array" and canonical_type(items.get("type")) == "object":
            return any(isinstance(o, list) and len(o) == len(value)
                       and all(_dict_ok(v, [a]) for v, a in zip(value, o)) for o in options)
        if kind == "string":
            return _std(value) in [_std(o) for o in options if isinstance(o, str)]
        if kind == "array":
            return [_std(v) for v in value] in [[_std(v) for v in o] for o in options]
    return value in options


def check_call(schema: dict[str, Any], call: dict[str, Any], truth: dict[str, dict]) -> CheckResult:
    """Check one call ``{"name", "arguments"}`` against one ground-truth entry ``{name: {param: [...]}}``."""
    (truth_name, truth_args), = truth.items()
    fn = _function_schema(schema)
    if call["name"] != truth_name:
        return CheckResult(False, f"wrong function name: {call['name']!r}, expected {truth_name!r}")
    params = fn.get("parameters") or {}
    props = params.get("properties") or {}
    args = call.get("arguments") or {}
    for name in params.get("required", []):
        if name not in args:
            return CheckResult(False, f"missing required parameter {name!r}")
    for name, value in args.items():
        if name not in props or name not in truth_args:
            return CheckResult(False, f"unexpected parameter {name!r}")
        options = truth_args[name]
        if canonical_type(props[name].get("type")) == "number" and type(value) is int:
            value = float(value)  # BFCL accepts an int where a float is expected
        ok, is_variable = _type_ok(value, props[name], options)
        if not ok:
            return CheckResult(False, f"type error for {name!r}: {value!r}")
        if not _value_ok(value, props[name], options, is_variable):
            return CheckResult(False, f"invalid value for {name!r}: {value!r}, allowed {truth_args[name]!r}")
    for name, options in truth_args.items():
        if name not in args and "" not in options:
            return CheckResult(False, f"parameter {name!r} not provided")
    return CheckResult(True)


def check(functions: list[dict[str, Any]], calls: list[dict[str, Any]],
          ground_truth: list[dict[str, dict]], category: str) -> CheckResult:
    """Score a model's calls for one question.

    Args:
        functions: the tools offered (BFCL, OpenAI tool or OpenAI function format).
        calls: the model's calls, ``[{"name": str, "arguments": dict}]`` (from
            ``models.chat.parse_tool_calls``).
        ground_truth: BFCL possible-answer list (``[]`` for irrelevance).
        category: BFCL or synthetic category name; ``irrelevance`` expects no call.
    """
    if category == "irrelevance":
        return CheckResult(not calls, "" if not calls else "a function was called")
    if len(calls) != len(ground_truth):
        return CheckResult(False, f"wrong number of calls: {len(calls)}, expected {len(ground_truth)}")
    schemas = {_function_schema(f)["name"]: f for f in functions}
    unmatched = list(range(len(calls)))
    last = CheckResult(True)
    for truth in ground_truth:
        name = next(iter(truth))
        if name not in schemas:
            return CheckResult(False, f"ground-truth function {name!r} is not among the tools")
        for j in unmatched:
            last = check_call(schemas[name], calls[j], truth)
            if last.valid:
                unmatched.remove(j)
                break
        else:
            return CheckResult(False, f"no call matches {name!r}: {last.error}")
    return CheckResult(True)
