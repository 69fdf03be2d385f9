"""Cross-check our BFCL AST checker against the official one (package ``bfcl-eval``).

Runs both checkers on every BFCL ground truth of the Python categories and on perturbed answers
(value changed, parameter dropped or added, wrong name, int for float, string case and punctuation,
call order, call count ...) and prints how often their verdicts agree.

``bfcl-eval`` pins numpy 1.26 and many provider SDKs, so it lives in its own environment that the
product never imports; only its checker module is needed, so ``--no-deps`` suffices::

    python3 -m venv /tmp/bfcl-venv && /tmp/bfcl-venv/bin/pip install --no-deps bfcl-eval
    /tmp/bfcl-venv/bin/python -m bench.bfcl_crosscheck [--json PATH]

Java and JavaScript categories are left out: BFCL checks them with language-specific converters
of string-encoded values, which our checker does not implement (it applies the Python rules).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import types
from pathlib import Path
from typing import Any, Callable

from models import bfcl
from models.checker import check

CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "irrelevance")


def _official_checker():
    # The checker imports the model registry (and through it every provider SDK) only to ask
    # whether a model rewrites "." in function names; a one-entry registry answers that.
    registry = types.ModuleType("bfcl_eval.constants.model_config")
    registry.MODEL_CONFIG_MAPPING = {"structkv": types.SimpleNamespace(underscore_to_dot=False)}
    sys.modules["bfcl_eval.constants.model_config"] = registry
    from bfcl_eval.constants.enums import Language
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker

    def official(functions, calls, truth, category):
        if category == "irrelevance":
            return not calls
        output = [{c["name"]: c["arguments"]} for c in calls]
        return ast_checker(functions, output, truth, Language.PYTHON, category, "structkv")["valid"]
    return official


def reference_calls(truth: list[dict], language: str = "python", skip_optional: bool = True,
                    functions: list[dict] | None = None) -> list[dict[str, Any]]:
    """One answer the ground truth accepts.

    Each parameter takes its first allowed value; ``""`` (BFCL: "may be left out") omits it, or,
    with ``skip_optional`` or when ``functions`` marks the parameter required, the next value is
    taken instead. For Java / JavaScript the values are written in their source form, as strings,
    which is how BFCL expects models to answer.
    """
    required = {f["name"]: set((f.get("parameters") or {}).get("required", [])) for f in functions or []}
    calls = []
    for entry in truth:
        (name, params), = entry.items()
        args = {}
        for p, options in params.items():
            if skip_optional or p in required.get(name, ()):
                value = next((o for o in options if o != ""), None)
            else:
                value = options[0] if options and options[0] != "" else None
            if value is not None:
                value = _first_of_nested(value)
                args[p] = value if language == "python" else _source_form(value)
        calls.append({"name": name, "arguments": args})
    return calls


def _source_form(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)


def _first_of_nested(value: Any) -> Any:
    if isinstance(value, dict):  # nested dicts list allowed values per key
        return {k: v[0] for k, v in value.items() if isinstance(v, list) and v and v[0] != ""}
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return [_first_of_nested(v) for v in value]
    return value


def _bump(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + " extra"
    if isinstance(value, list):
        return value + value[:1] if value else [1]
    if isinstance(value, dict):
        return {**value, "extra_key": 1}
    return value


def _map_first(calls, fn) -> list | None:
    calls = copy.deepcopy(calls)
    for call in calls:
        for p in list(call["arguments"]):
            new = fn(call["arguments"][p])
            if new is not None:
                call["arguments"][p] = new
                return calls
    return None


def _omit_optional(truth):
    def run(calls):
        calls = copy.deepcopy(calls)
        for call, entry in zip(calls, truth):
            params = next(iter(entry.values()))
            call["arguments"] = {p: v for p, v in call["arguments"].items() if "" not in params.get(p, [])}
        return calls
    return run


def _perturbations(truth: list[dict]) -> dict[str, Callable[[list], list | None]]:
    return {
        "ground_truth": lambda c: c,
        "omit_optional": _omit_optional(truth),
        "wrong_value": lambda c: _map_first(c, _bump),
        "drop_param": lambda c: ([{**x, "arguments": dict(list(x["arguments"].items())[1:])} for x in c]
                                 if c and c[0]["arguments"] else None),
        "extra_param": lambda c: [{**c[0], "arguments": {**c[0]["arguments"], "zz_extra": 1}}] + c[1:] if c else None,
        "wrong_name": lambda c: [{**c[0], "name": c[0]["name"] + "_v2"}] + c[1:] if c else None,
        "int_for_float": lambda c: _map_first(c, lambda v: int(v) if isinstance(v, float) and v.is_integer() else None),
        "float_for_int": lambda c: _map_first(c, lambda v: float(v) if type(v) is int else None),
        "number_as_string": lambda c: _map_first(c, lambda v: str(v) if type(v) in (int, float) else None),
        "string_case_punct": lambda c: _map_first(c, lambda v: v.upper().replace(" ", "_") + "."
                                                  if isinstance(v, str) else None),
        "reversed_calls": lambda c: c[::-1] if len(c) > 1 else None,
        "drop_call": lambda c: c[:-1] if c else None,
        "duplicate_call": lambda c: c + c[:1] if c else None,
        "no_call": lambda c: [],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bfcl_crosscheck", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the agreement table as JSON")
    args = ap.parse_args(argv)
    try:
        official = _official_checker()
    except ImportError as e:
        print(f"error: bfcl-eval is not importable here ({e}); see the module docstring", file=sys.stderr)
        return 2
    table: dict[str, dict[str, list[int]]] = {}
    disagreements = []
    for category in CATEGORIES:
        for q in bfcl.load_questions(category):
            truth = q.ground_truth or []
            base = reference_calls(truth) if category != "irrelevance" else [
                {"name": q.functions[0]["name"], "arguments": {}}]
            for name, perturb in _perturbations(truth).items():
                calls = perturb(copy.deepcopy(base))
                if calls is None:
                    continue
                ours = check(q.functions, calls, truth, category).valid
                theirs = official(q.functions, copy.deepcopy(calls), truth, category)
                cell = table.setdefault(category, {}).setdefault(name, [0, 0, 0])
                cell[0] += 1
                cell[1] += ours == theirs
                cell[2] += theirs
                if ours != theirs:
                    disagreements.append({"id": q.id, "perturbation": name, "ours": ours,
                                          "official": theirs, "calls": calls})
    total = sum(c[0] for t in table.values() for c in t.values())
    agree = sum(c[1] for t in table.values() for c in t.values())
    print(f"{'category':<18} {'perturbation':<18} {'cases':>6} {'agree':>6} {'official valid':>15}")
    for category, rows in table.items():
        for name, (n, a, v) in rows.items():
            print(f"{category:<18} {name:<18} {n:>6} {a:>6} {v:>15}")
    print(f"agreement: {agree}/{total} = {100 * agree / total:.2f} %")
    for d in disagreements[:20]:
        print("disagree:", json.dumps(d)[:300])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"agree": agree, "total": total, "table": table,
                                         "disagreements": disagreements}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
