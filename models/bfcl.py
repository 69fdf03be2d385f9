"""BFCL data: loading function definitions and questions, and converting BFCL's schema dialect.

BFCL (Berkeley Function-Calling Leaderboard, v4, non-live categories) writes parameter schemas in
its own dialect: ``dict`` for objects, ``float`` for numbers, ``tuple`` for arrays, ``any``, and
Java / JavaScript type names (``String``, ``HashMap``, ``long`` ...). :func:`to_json_schema`
turns such a schema into standard JSON Schema (draft 2020-12), which the chat template renders and
the grammar compiler accepts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

# The BFCL checkout shipped beside the project (../shared/data/bfcl); override with BFCL_DIR.
DEFAULT_BFCL_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "bfcl"

# Non-live categories whose files hold questions; the first five have ground truth.
CATEGORIES = ("simple_python", "simple_java", "simple_javascript", "multiple", "parallel",
              "parallel_multiple", "irrelevance")

_TYPE_MAP = {
    "dict": "object", "object": "object", "hashmap": "object",
    "float": "number", "double": "number", "number": "number",
    "integer": "integer", "int": "integer", "long": "integer",
    "string": "string", "str": "string", "char": "string",
    "boolean": "boolean", "bool": "boolean",
    "array": "array", "tuple": "array", "arraylist": "array", "list": "array",
    "any": "string", "": None,  # BFCL's own OpenAPI conversion reads "any" as string
}


class BFCLDataError(ValueError):
    """A BFCL data file is missing or one of its lines is not what BFCL writes."""


def bfcl_dir() -> Path:
    return Path(os.environ.get("BFCL_DIR", DEFAULT_BFCL_DIR))


def canonical_type(bfcl_type: str | None) -> str | None:
    """Map a BFCL type name (any dialect) to a JSON Schema type name (None: no type given).

    Raises:
        BFCLDataError: for a type name BFCL does not use.
    """
    if bfcl_type is None:
        return None
    key = str(bfcl_type).strip().lower()
    if key not in _TYPE_MAP:
        raise BFCLDataError(f"unknown BFCL type {bfcl_type!r}")
    return _TYPE_MAP[key]


LANGUAGES = {"simple_java": "java", "simple_javascript": "javascript"}


def _is_optional(node: Any) -> bool:
    return isinstance(node, dict) and str(node.get("optional", "")).lower() == "true"


def to_json_schema(node: dict[str, Any], language: str = "python") -> dict[str, Any]:
    """Convert one BFCL schema node (and its children) to JSON Schema.

    Keeps ``description``, ``enum``, ``required``, ``properties``, ``items`` and numeric bounds;
    a property marked ``"optional": true`` leaves ``required``. For ``java`` / ``javascript``
    functions, as BFCL does, every parameter is a string holding the value's source form (the
    description names the original type).
    """
    if language != "python" and isinstance(node.get("properties"), dict):
        props = {}
        for name, sub in node["properties"].items():
            kind = sub.get("type", "any")
            props[name] = {"type": "string", "description": (sub.get("description", "") + f" This is {language.capitalize()} "
                           f"{kind} type parameter in string representation.").strip()}
        required = [r for r in node.get("required", []) if r in props and not _is_optional(node["properties"][r])]
        return {"type": "object", "properties": props, **({"required": required} if required else {})}
    out: dict[str, Any] = {}
    json_type = canonical_type(node.get("type"))
    if json_type is not None:
        out["type"] = json_type
    if "description" in node:
        out["description"] = node["description"]
    if "enum" in node:
        out["enum"] = list(node["enum"])
    for key in ("minimum", "maximum"):
        if key in node:
            out[key] = node[key]
    if json_type == "object" and isinstance(node.get("properties"), dict):
        out["properties"] = {k: to_json_schema(v) for k, v in node["properties"].items()}
        required = [r for r in node.get("required", [])
                    if r in out["properties"] and not _is_optional(node["properties"][r])]
        if required:
            out["required"] = required
    if json_type == "array" and isinstance(node.get("items"), dict):
        out["items"] = to_json_schema(node["items"])
    return out


def to_openai_tool(function: dict[str, Any], language: str = "python") -> dict[str, Any]:
    """A BFCL function definition as an OpenAI ``tools`` entry (``{"type": "function", ...}``)."""
    params = to_json_schema(function.get("parameters") or {"type": "dict", "properties": {}}, language)
    params.setdefault("type", "object")
    params.setdefault("properties", {})
    return {"type": "function", "function": {
        "name": function["name"], "description": function.get("description", ""),
        "parameters": params}}


@dataclass(frozen=True)
class BFCLQuestion:
    """One BFCL entry: ``messages`` (OpenAI chat format), ``functions`` (BFCL dialect) and, when
    the category has it, ``ground_truth`` (BFCL possible-answer format)."""
    id: str
    category: str
    language: str
    messages: list[dict[str, str]]
    functions: list[dict[str, Any]]
    ground_truth: list[dict[str, Any]] | None


def _read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    if not path.is_file():
        raise BFCLDataError(f"BFCL data file not found: {path} (set BFCL_DIR to the BFCL folder)")
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise BFCLDataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict) or "id" not in row:
                raise BFCLDataError(f"{path}:{lineno}: expected an object with an 'id' field")
            yield lineno, row


def _check_function(fn: Any, where: str) -> dict[str, Any]:
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise BFCLDataError(f"{where}: a function definition needs a string 'name'")
    params = fn.get("parameters", {})
    if not isinstance(params, dict) or not isinstance(params.get("properties", {}), dict):
        raise BFCLDataError(f"{where}: function {fn['name']!r} has malformed 'parameters'")
    return fn


def load_questions(category: str, root: Path | None = None) -> list[BFCLQuestion]:
    """Load the questions (and ground truth, when present) of one non-live BFCL category.

    Raises:
        BFCLDataError: unknown category, missing file, or a malformed line (names file and line).
    """
    if category not in CATEGORIES:
        raise BFCLDataError(f"unknown BFCL category {category!r}; choose from {', '.join(CATEGORIES)}")
    root = Path(root) if root else bfcl_dir()
    answers: dict[str, list] = {}
    answer_path = root / "possible_answer" / f"BFCL_v4_{category}.json"
    if answer_path.is_file():
        for lineno, row in _read_jsonl(answer_path):
            if not isinstance(row.get("ground_truth"), list):
                raise BFCLDataError(f"{answer_path}:{lineno}: missing 'ground_truth' list")
            answers[row["id"]] = row["ground_truth"]
    path = root / f"BFCL_v4_{category}.json"
    out = []
    for lineno, row in _read_jsonl(path):
        where = f"{path}:{lineno}"
        turns = row.get("question")
        if not (isinstance(turns, list) and turns and isinstance(turns[0], list)):
            raise BFCLDataError(f"{where}: 'question' must be a list of turns")
        functions = [_check_function(fn, where) for fn in row.get("function", [])]
        out.append(BFCLQuestion(row["id"], category, LANGUAGES.get(category, "python"), list(turns[0]), functions,
                                answers.get(row["id"])))
    return out


def load_functions(root: Path | None = None) -> list[dict[str, Any]]:
    """All distinct BFCL function definitions (first definition of each name), in file order."""
    seen: dict[str, dict[str, Any]] = {}
    for category in CATEGORIES:
        for q in load_questions(category, root):
            for fn in q.functions:
                seen.setdefault(fn["name"], fn)
    return list(seen.values())
