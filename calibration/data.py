"""The user's calibration data: a BFCL question file or an OpenAI-style JSONL, split into dev / held-out.

Two formats (``--data FILE``; ``--data-format auto`` tells them apart by the first line):

- **BFCL** (the layout of ``../shared/data/bfcl``): one JSON object per line with ``id``,
  ``question`` (a list of turns, the first one used) and ``function`` (BFCL function definitions);
  the expected calls are in a possible-answer file with the same ids (``ground_truth``), read from
  ``--answers FILE`` or else from ``possible_answer/<name of FILE>`` beside FILE. Questions whose id
  starts with ``irrelevance`` expect no call and need no answer.
- **OpenAI JSONL**: one JSON object per line with ``messages`` (OpenAI chat format, string contents)
  and either ``tools`` plus the expected ``tool_calls`` (OpenAI ``[{"type": "function", "function":
  {"name", "arguments"}}]``, arguments a JSON string or an object; ``[]`` means "no call"), or
  ``response_format`` (``{"type": "json_schema", "json_schema": {"schema": ...}}``) plus the
  expected JSON value as ``expected_json``. As in OpenAI's fine-tuning files, the expected answer may
  instead be the last message, an ``assistant`` turn (its ``tool_calls``, or for ``response_format``
  its content holding the JSON). An optional ``id`` names the example (default ``line<N>``).

Every example is scored with the BFCL AST checker (``models.checker``): a tool-call example's
expected calls become BFCL ground truth with one allowed value per argument; a ``response_format``
example whose schema is an object is checked as the arguments of one call against the schema, any
other schema by equality of the parsed JSON.

The split is made here: a seeded shuffle of the examples (after ``limit``, the first N of the file),
the first ``round(dev_fraction * N)`` of it is dev (used for calibration), the rest held out. Its
description (file paths, SHA-256, counts, seed, ids) goes into the artifact's manifest.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMATS = ("auto", "bfcl", "openai")


class CalibrationDataError(ValueError):
    """The calibration data cannot be used: missing file, malformed line (the message names the
    file and line), an example without an expected answer, or an empty split."""


@dataclass(frozen=True)
class CalItem:
    """One calibration example.

    Attributes:
        id: example id (unique in its file).
        category: BFCL category (BFCL files), or the shape of the expected answer (OpenAI JSONL:
            ``simple`` / ``multiple`` / ``parallel`` / ``parallel_multiple`` / ``irrelevance``, or
            ``json``).
        messages: the conversation, OpenAI chat format, the answer to produce not included.
        tools: OpenAI ``tools`` entries, or None for a ``response_format`` example.
        functions: the tools as the checker reads them.
        ground_truth: BFCL possible-answer list (``[]``: no call expected).
        schema: the ``response_format`` JSON schema (None for tool examples); ``strict`` its flag.
        expected: the expected JSON value of a ``response_format`` example.
    """
    id: str
    category: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    functions: list[dict[str, Any]] = field(default_factory=list)
    ground_truth: list[dict[str, Any]] = field(default_factory=list)
    schema: dict[str, Any] | None = None
    strict: bool = False
    expected: Any = None

    @classmethod
    def from_bench(cls, item) -> "CalItem":
        """From a ``bench.accuracy.Item`` (the synthetic task, real BFCL)."""
        return cls(item.id, item.category, item.messages, item.tools, item.functions, item.ground_truth)

    def grammar(self):
        """The ``GrammarSpec`` the example is generated under (tools, or its JSON schema)."""
        from replicas.grammar import GrammarSpec
        if self.schema is not None:
            return GrammarSpec("json_schema", self.schema, strict=self.strict)
        return GrammarSpec("tools", {"tools": self.tools, "tool_choice": "auto"})

    def score(self, text: str) -> bool:
        """Whether the generated ``text`` is right (BFCL AST rules)."""
        from models.checker import check, check_call
        if self.schema is None:
            from models.chat import parse_tool_calls
            try:
                calls, _ = parse_tool_calls(text)
            except ValueError:
                return self.category == "irrelevance"  # unparseable output is "no call", as BFCL counts it
            return check(self.functions, calls, self.ground_truth, self.category).valid
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return False
        if isinstance(self.expected, dict) and isinstance(value, dict):
            truth = {"response": {k: [_truth_value(v)] for k, v in self.expected.items()}}
            return check_call({"name": "response", "parameters": self.schema},
                              {"name": "response", "arguments": value}, truth).valid
        return value == self.expected


def _truth_value(value: Any) -> Any:
    # BFCL writes nested dicts with a list of allowed values per key (as models.synth does).
    if isinstance(value, dict):
        return {k: [_truth_value(v)] for k, v in value.items()}
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return [_truth_value(v) for v in value]
    return value


@dataclass(frozen=True)
class DataSplit:
    """A data file split into ``dev`` (calibration) and ``held_out`` examples; ``source`` is the
    manifest record (format, paths, SHA-256, counts, seed, ids)."""
    dev: list[CalItem]
    held_out: list[CalItem]
    source: dict[str, Any]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _lines(path: Path, what: str):
    """``(lineno, object)`` for each non-empty line of a JSONL file."""
    if not path.is_file():
        raise CalibrationDataError(f"{what} not found: {path}")
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise CalibrationDataError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise CalibrationDataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            yield lineno, row


def detect_format(path: Path) -> str:
    """``bfcl`` or ``openai``, from the first non-empty line of ``path``.

    Raises:
        CalibrationDataError: missing or empty file, or a first line of neither format.
    """
    for lineno, row in _lines(path, "data file"):
        if "question" in row and "function" in row:
            return "bfcl"
        if "messages" in row:
            return "openai"
        raise CalibrationDataError(f"{path}:{lineno}: neither a BFCL question (keys 'question', 'function') nor "
                                   f"an OpenAI-style example (key 'messages'); keys are {sorted(row)}")
    raise CalibrationDataError(f"{path}: no examples (the file is empty)")


# ---------------------------------------------------------------------------- BFCL
def default_answers(path: Path) -> Path:
    """Where a BFCL question file's possible answers are, in BFCL's layout."""
    return path.parent / "possible_answer" / path.name


def load_bfcl(path: Path, answers: Path | None = None, limit: int | None = None) -> tuple[list[CalItem], Path | None]:
    """The examples of a BFCL question file (the first ``limit``) and the answer file read.

    Raises:
        CalibrationDataError: see the module docstring.
    """
    from models import bfcl
    rows = []
    for lineno, row in _lines(path, "data file"):
        if limit is not None and len(rows) >= limit:
            break
        rows.append((lineno, row))
    needs_answers = any(not str(r.get("id", "")).startswith("irrelevance") for _, r in rows)
    answers_path = Path(answers) if answers else default_answers(path)
    truth: dict[str, list] = {}
    if answers is not None or answers_path.is_file() or needs_answers:
        if not answers_path.is_file():
            raise CalibrationDataError(f"answer file not found: {answers_path} (the expected calls of {path}; "
                                       f"give it with --answers FILE)")
        for lineno, row in _lines(answers_path, "answer file"):
            if not isinstance(row.get("id"), str) or not isinstance(row.get("ground_truth"), list):
                raise CalibrationDataError(f"{answers_path}:{lineno}: expected an object with a string 'id' and a "
                                           f"'ground_truth' list")
            truth[row["id"]] = row["ground_truth"]
    else:
        answers_path = None
    items, seen = [], set()
    for lineno, row in rows:
        where = f"{path}:{lineno}"
        qid = row.get("id")
        if not isinstance(qid, str) or not qid:
            raise CalibrationDataError(f"{where}: a BFCL question needs a string 'id'")
        if qid in seen:
            raise CalibrationDataError(f"{where}: id {qid!r} appears twice")
        seen.add(qid)
        turns = row.get("question")
        if not (isinstance(turns, list) and turns and isinstance(turns[0], list) and turns[0]):
            raise CalibrationDataError(f"{where}: 'question' must be a non-empty list of turns (lists of messages)")
        _check_messages(turns[0], where)
        if not isinstance(row.get("function"), list) or not row["function"]:
            raise CalibrationDataError(f"{where}: 'function' must be a non-empty list of function definitions")
        try:
            functions = [bfcl._check_function(fn, where) for fn in row["function"]]
            category = qid.rsplit("_", 1)[0] if qid.rsplit("_", 1)[-1].isdigit() else qid
            language = bfcl.LANGUAGES.get(category, "python")
            tools = [bfcl.to_openai_tool(f, language) for f in functions]
        except bfcl.BFCLDataError as e:
            raise CalibrationDataError(f"{where}: {e}" if not str(e).startswith(where) else str(e)) from None
        if qid.startswith("irrelevance"):
            category, gt = "irrelevance", []
        elif qid not in truth:
            raise CalibrationDataError(f"{where}: no expected answer for id {qid!r} in {answers_path}")
        else:
            gt = truth[qid]
            names = {f["name"] for f in functions}
            for call in gt:
                if not (isinstance(call, dict) and len(call) == 1 and next(iter(call)) in names):
                    raise CalibrationDataError(f"{answers_path}: the answer of {qid!r} ({where}) names a call "
                                               f"{call!r} that is not one of its functions {sorted(names)}")
        items.append(CalItem(qid, category, list(turns[0]), tools, functions if language == "python" else tools, gt))
    return items, answers_path


# ---------------------------------------------------------------------------- OpenAI JSONL
_ROLES = ("system", "developer", "user", "assistant", "tool")


def _check_messages(messages: Any, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise CalibrationDataError(f"{where}: 'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise CalibrationDataError(f"{where}: messages[{i}] needs a 'role' among {', '.join(_ROLES)}")
        if not isinstance(m.get("content", ""), str) and not (m.get("role") == "assistant" and m.get("content") is None):
            raise CalibrationDataError(f"{where}: messages[{i}].content must be a string")


def _check_tools(tools: Any, where: str) -> list[dict]:
    if not isinstance(tools, list) or not tools:
        raise CalibrationDataError(f"{where}: 'tools' must be a non-empty list of OpenAI tool entries")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and isinstance(fn.get("parameters", {}), dict)):
            raise CalibrationDataError(f"{where}: tools[{i}] must be {{\"type\": \"function\", \"function\": "
                                       f"{{\"name\": str, \"parameters\": object}}}}")
    return tools


def _expected_calls(calls: Any, tools: list[dict], where: str) -> list[dict]:
    """The expected calls as ``[{"name", "arguments"}]``."""
    if not isinstance(calls, list):
        raise CalibrationDataError(f"{where}: 'tool_calls' must be a list (empty: no call expected)")
    names = {t["function"]["name"] for t in tools}
    out = []
    for i, c in enumerate(calls):
        fn = c.get("function", c) if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise CalibrationDataError(f"{where}: tool_calls[{i}] needs a function name")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise CalibrationDataError(f"{where}: tool_calls[{i}].arguments is not valid JSON ({e.msg})") from None
        if not isinstance(args, dict):
            raise CalibrationDataError(f"{where}: tool_calls[{i}].arguments must be a JSON object")
        if fn["name"] not in names:
            raise CalibrationDataError(f"{where}: tool_calls[{i}] calls {fn['name']!r}, which is not among the tools "
                                       f"{sorted(names)}")
        out.append({"name": fn["name"], "arguments": args})
    return out


def _check_scorable(item: CalItem, answer: str, where: str) -> CalItem:
    """The expected answer must pass the checker against the example's own tools or schema (an
    argument the schema does not name, a value of the wrong type, a type the checker cannot read)."""
    try:
        ok = item.score(answer)
    except ValueError as e:
        raise CalibrationDataError(f"{where}: the checker cannot score this example ({e})") from None
    if not ok:
        what = "tools" if item.schema is None else "schema"
        raise CalibrationDataError(f"{where}: the expected answer does not pass the checker against the example's "
                                   f"own {what} (an argument outside the schema, or a value of the wrong type?)")
    return item


def _shape(calls: list[dict], num_tools: int) -> str:
    if not calls:
        return "irrelevance"
    many = len(calls) > 1
    if num_tools > 1:
        return "parallel_multiple" if many else "multiple"
    return "parallel" if many else "simple"


def load_openai(path: Path, limit: int | None = None) -> list[CalItem]:
    """The examples of an OpenAI-style JSONL file (the first ``limit``).

    Raises:
        CalibrationDataError: see the module docstring.
    """
    items, seen = [], set()
    for lineno, row in _lines(path, "data file"):
        if limit is not None and len(items) >= limit:
            break
        where = f"{path}:{lineno}"
        qid = row.get("id", f"line{lineno}")
        if not isinstance(qid, str) or not qid:
            raise CalibrationDataError(f"{where}: 'id' must be a non-empty string")
        if qid in seen:
            raise CalibrationDataError(f"{where}: id {qid!r} appears twice")
        seen.add(qid)
        messages = row.get("messages")
        _check_messages(messages, where)
        messages = [dict(m) for m in messages]
        last = messages[-1] if messages[-1]["role"] == "assistant" else None
        if last is not None:
            messages = messages[:-1]
            if not messages:
                raise CalibrationDataError(f"{where}: 'messages' holds only the expected assistant turn")
        has_tools, has_format = "tools" in row, "response_format" in row
        if has_tools == has_format:
            raise CalibrationDataError(f"{where}: give either 'tools' (with the expected 'tool_calls') or "
                                       f"'response_format' (with 'expected_json'), not {'both' if has_tools else 'neither'}")
        if has_tools:
            tools = _check_tools(row["tools"], where)
            if "tool_calls" in row:
                expected = row["tool_calls"]
            elif last is not None:
                expected = last.get("tool_calls") or []
            else:
                raise CalibrationDataError(f"{where}: no expected answer: add 'tool_calls' (or [] for no call), or end "
                                           f"'messages' with the expected assistant turn")
            calls = _expected_calls(expected, tools, where)
            gt = [{c["name"]: {k: [_truth_value(v)] for k, v in c["arguments"].items()}} for c in calls]
            from models.chat import render_answer
            items.append(_check_scorable(CalItem(qid, _shape(gt, len(tools)), messages, tools, tools, gt),
                                         render_answer(calls), where))
            continue
        rf = row["response_format"]
        schema = rf.get("json_schema", {}).get("schema") if isinstance(rf, dict) and isinstance(rf.get("json_schema"), dict) else None
        if not (isinstance(rf, dict) and rf.get("type") == "json_schema" and isinstance(schema, dict)):
            raise CalibrationDataError(f"{where}: 'response_format' must be {{\"type\": \"json_schema\", \"json_schema\": "
                                       f"{{\"schema\": object}}}}")
        if "expected_json" in row:
            value = row["expected_json"]
        elif last is not None and isinstance(last.get("content"), str):
            try:
                value = json.loads(last["content"])
            except json.JSONDecodeError as e:
                raise CalibrationDataError(f"{where}: the expected assistant content is not valid JSON ({e.msg})") from None
        else:
            raise CalibrationDataError(f"{where}: no expected answer: add 'expected_json', or end 'messages' with "
                                       f"the expected assistant turn")
        try:
            import jsonschema
            jsonschema.validate(value, schema)
        except jsonschema.ValidationError as e:
            raise CalibrationDataError(f"{where}: 'expected_json' does not follow the schema ({e.message})") from None
        except jsonschema.SchemaError as e:
            raise CalibrationDataError(f"{where}: 'response_format' schema is invalid ({e.message})") from None
        items.append(_check_scorable(CalItem(qid, "json", messages, None, [], [], schema,
                                             bool(rf["json_schema"].get("strict", False)), value),
                                     json.dumps(value), where))
    return items


# ---------------------------------------------------------------------------- the split
def load_split(path: str | Path, answers: str | Path | None = None, data_format: str = "auto",
               dev_fraction: float = 0.5, seed: int = 0, limit: int | None = None) -> DataSplit:
    """Read a data file and split it (see the module docstring).

    Args:
        path: the data file; answers: BFCL possible-answer file (BFCL format only).
        data_format: ``auto``, ``bfcl`` or ``openai``.
        dev_fraction: share of the examples used for calibration, in (0, 1).
        seed: seed of the shuffle.
        limit: read only the first ``limit`` examples of the file.

    Raises:
        CalibrationDataError: missing file, malformed line, no expected answer, bad settings, or
            a split with no dev or no held-out example.
    """
    path = Path(path).resolve()
    if data_format not in FORMATS:
        raise CalibrationDataError(f"unknown data format {data_format!r}; choose from {', '.join(FORMATS)}")
    if not 0.0 < dev_fraction < 1.0:
        raise CalibrationDataError(f"dev fraction must be in (0, 1), got {dev_fraction}")
    if limit is not None and limit < 1:
        raise CalibrationDataError(f"limit must be at least 1, got {limit}")
    fmt = detect_format(path) if data_format == "auto" else data_format
    if answers is not None and fmt != "bfcl":
        raise CalibrationDataError(f"--answers is for BFCL-format data; {path} is an OpenAI-style JSONL")
    answers_path = None
    if fmt == "bfcl":
        items, answers_path = load_bfcl(path, Path(answers).resolve() if answers else None, limit)
    else:
        items = load_openai(path, limit)
    if not items:
        raise CalibrationDataError(f"{path}: no examples (the file is empty)")
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    n_dev = round(dev_fraction * len(items))
    if n_dev == 0 or n_dev == len(items):
        raise CalibrationDataError(f"{path}: {len(items)} examples at dev fraction {dev_fraction} leave "
                                   f"{'no dev' if n_dev == 0 else 'no held-out'} example; use more examples "
                                   f"or another --dev-fraction")
    dev = [items[i] for i in order[:n_dev]]
    held = [items[i] for i in order[n_dev:]]
    counts: dict[str, int] = {}
    for it in dev:
        counts[it.category] = counts.get(it.category, 0) + 1
    source = {"format": fmt, "path": str(path), "sha256": sha256_file(path),
              "answers": str(answers_path) if answers_path else None,
              "answers_sha256": sha256_file(answers_path) if answers_path else None,
              "limit": limit, "seed": seed, "dev_fraction": dev_fraction,
              "examples": len(items), "dev": len(dev), "held_out": len(held), "dev_categories": counts,
              "dev_ids": [it.id for it in dev], "held_out_ids": [it.id for it in held]}
    return DataSplit(dev, held, source)


def cli_split(ap, args):
    """The ``--data`` options of ``python -m calibration pask|compilerkv``, checked and loaded
    before anything is written: the split, None without ``--data``, or False after printing the
    data error (the command exits 2). Option conflicts go to ``ap.error``."""
    if (args.answers or args.limit is not None) and not args.data:
        ap.error("--answers and --limit apply to --data")
    if args.gpus_per_worker < 0:
        ap.error("--gpus-per-worker must be at least 0")
    if not args.data:
        return None
    try:
        return load_split(args.data, args.answers, args.data_format, args.dev_fraction, args.seed, args.limit)
    except CalibrationDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return False
