"""Grammar coverage on real schemas.

    python -m bench.grammar_coverage bfcl            # BFCL functions and ground-truth calls
    python -m bench.grammar_coverage jsonschemabench [--limit N] [--timeout-s S]

``bfcl``: every BFCL function definition converts to JSON Schema and compiles as a tool grammar;
every ground-truth call (first allowed value of each parameter) validates against its schema with
``jsonschema`` and is accepted token by token, then EOS, by the question's compiled tool grammar.

``jsonschemabench``: every schema of JSONSchemaBench either compiles (with the backend
``replicas.grammar.backend_for`` picks: xgrammar or llguidance) or raises ``GrammarCompileError``
within the time bound; reports served / refused / timed out per subset and per backend, the
refusals left grouped by reason, how many served schemas have a ``oneOf`` negation narrowed
(``replicas/schema_oneof.py``: sound, but some valid instances cannot be produced), and, for comparison, what ``--before-ref``'s rule served (a
schema its ``unenforced_keywords`` flags refused, every other compiled by xgrammar; compiled again
here only where this code sends it to llguidance). Each subset runs in a child process, so a crash
inside the compiler is counted and the run goes on.
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

from tqdm import tqdm

JSONSCHEMABENCH_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "jsonschemabench" / "schemas"


def _compiler(timeout_s: float):
    from transformers import AutoTokenizer

    from models import resolve_checkpoint
    from replicas.grammar import GrammarCompiler
    tok = AutoTokenizer.from_pretrained(resolve_checkpoint())
    return tok, GrammarCompiler(tok, len(tok), timeout_s=timeout_s, isolate=False)  # each subset runs in its own process


def bfcl_coverage(timeout_s: float) -> dict:
    import jsonschema

    from bench.bfcl_crosscheck import reference_calls
    from models import bfcl, chat
    from replicas.errors import GrammarCompileError
    from replicas.grammar import GrammarSpec
    tok, compiler = _compiler(timeout_s)
    eos = tok.convert_tokens_to_ids(chat.IM_END)
    report = {"functions": 0, "functions_compiled": 0, "calls": 0, "calls_schema_valid": 0,
              "calls_grammar_accepted": 0, "failures": []}
    seen = set()
    for category in bfcl.CATEGORIES:
        for q in tqdm(bfcl.load_questions(category), desc=category, leave=False):
            tools = [bfcl.to_openai_tool(f, q.language) for f in q.functions]
            for tool in tools:
                key = json.dumps(tool, sort_keys=True)
                if key in seen:
                    continue
                seen.add(key)
                report["functions"] += 1
                try:
                    compiler.compile(GrammarSpec("tools", {"tools": [tool], "tool_choice": "required"}))
                    report["functions_compiled"] += 1
                except GrammarCompileError as e:
                    report["failures"].append({"id": q.id, "function": tool["function"]["name"], "error": str(e)})
            if not q.ground_truth:
                continue
            calls = reference_calls(q.ground_truth, q.language, skip_optional=False, functions=q.functions)
            by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
            for call in calls:
                report["calls"] += 1
                try:
                    jsonschema.validate(call["arguments"], by_name[call["name"]])
                    report["calls_schema_valid"] += 1
                except jsonschema.ValidationError as e:
                    report["failures"].append({"id": q.id, "call": call["name"], "error": f"schema: {e.message}"})
            try:
                matcher = compiler.matcher(GrammarSpec("tools", {"tools": tools, "tool_choice": "required"}))
            except GrammarCompileError as e:
                report["failures"].append({"id": q.id, "error": str(e)})
                continue
            # A JSON object is unordered; the grammar (and the model) write keys in schema order.
            ordered = [{"name": c["name"], "arguments": dict(sorted(
                c["arguments"].items(), key=lambda kv, order=list(by_name[c["name"]]["properties"]):
                order.index(kv[0]) if kv[0] in order else len(order)))} for c in calls]
            ids = tok(chat.render_answer(ordered), add_special_tokens=False)["input_ids"]
            accepted = all(matcher.accept_token(t) for t in ids) and matcher.accept_token(eos)
            report["calls_grammar_accepted"] += len(calls) if accepted else 0
            if not accepted:
                report["failures"].append({"id": q.id, "error": "grammar rejected the ground-truth calls"})
    return report


def _before_check(ref: str):
    """``unenforced_keywords`` as git ``ref`` has it (the refusal rule of that commit)."""
    import subprocess
    import types
    root = Path(__file__).resolve().parents[1]
    code = subprocess.run(["git", "show", f"{ref}:replicas/grammar.py"], cwd=root, check=True,
                          capture_output=True, text=True).stdout
    mod = types.ModuleType(f"grammar_at_{ref}")
    sys.modules[mod.__name__] = mod   # (its dataclasses look their module up)
    exec(compile(code, f"{ref}:replicas/grammar.py", "exec"), mod.__dict__)
    return mod.unenforced_keywords


def refusal_reason(message: str) -> str:
    """A refusal grouped by cause: the keyword classes a "cannot enforce" refusal lists (``not``,
    ``oneOf with members that may overlap``, ``format uri-reference``), else the message with
    numbers, quotes and places stripped."""
    import re
    if "cannot enforce" in message and "): what llguidance names (llguidance: " in message:
        return "llguidance: " + re.sub(r"json-schema:///\S*|\d+", "X", message.split("(llguidance: ", 1)[1])[:70]
    if "cannot enforce" in message:
        places = message.split(": ", 1)[1].split(" (llguidance:")[0].split("; ")
        kinds = sorted({re.sub(r" at \$.*", "", p) for p in places})
        return ", ".join(kinds)
    msg = re.sub(r"\(llguidance: ", "", message)
    return re.sub(r"\d+", "N", re.sub(r"'[^']*'|\"[^\"]*\"|`[^`]*`", "X", msg))[:90]


def _status(compile_fn) -> tuple[str, str]:
    from replicas.errors import GrammarCompileError
    try:
        compile_fn()
        return "served", ""
    except GrammarCompileError as e:
        return ("timeout" if "did not compile within" in str(e) else "refused"), str(e)


def _subset_worker(path: str, start: int, timeout_s: float, before_ref: str | None, conn) -> None:
    from replicas.errors import GrammarCompileError
    from replicas.grammar import GrammarSpec, LLGuidanceGrammar, _check, backend_for
    before_check = _before_check(before_ref) if before_ref else None
    _, compiler = _compiler(timeout_s)
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    for i in range(start, len(rows)):
        schema = rows[i].get("json_schema", rows[i].get("schema", rows[i]))
        spec = GrammarSpec("json_schema", schema)
        t0 = time.perf_counter()
        try:
            backend = backend_for(_check(spec))
        except GrammarCompileError:
            backend = "-"
        after, message = _status(lambda: compiler.compile(spec))
        seconds = time.perf_counter() - t0
        narrowed = False
        if after == "served":   # (a fallback may have served it: the cache says which backend did)
            compiled = compiler.compile(spec)
            backend = "llguidance" if isinstance(compiled, LLGuidanceGrammar) else "xgrammar"
            narrowed = bool(getattr(compiled, "narrowed", ()))
        before = None
        if before_check is not None:  # the ref's rule: refused before compiling, else xgrammar compiled it
            if isinstance(schema, str) or before_check(schema):
                before = "refused"
            elif backend == "xgrammar":
                before = after
            else:
                before = _status(lambda: compiler._compile_in_thread("xgrammar", _check(spec)))[0]
        conn.send((i, {"backend": backend, "after": after, "before": before, "seconds": seconds, "narrowed": narrowed,
                       "reason": refusal_reason(message) if after == "refused" else ""}))
    conn.send(None)


def _empty_counts() -> dict:
    return {"served": 0, "refused": 0, "timeout": 0, "crashed": 0}


def jsonschemabench_coverage(timeout_s: float, limit: int | None, progress_path: Path | None = None,
                             subsets: list[str] | None = None, before_ref: str | None = None) -> dict:
    """Per subset: ``after`` (served / refused / timeout / crashed, with this code's choice of
    backend), the same per backend (``by_backend``; "-": refused before a backend was chosen),
    ``before`` (the same counts under ``before_ref``'s refusal rule, xgrammar only: a schema its
    ``unenforced_keywords`` flags is refused, any other is compiled by xgrammar), compile seconds
    and the refusal reasons left (``reasons``: reason -> count). Subsets already in
    ``progress_path`` (a stopped run's report) are kept and not rerun."""
    import collections
    report = json.loads(progress_path.read_text()) if progress_path and progress_path.is_file() else {}
    ctx = mp.get_context("spawn")
    for path in sorted(JSONSCHEMABENCH_DIR.glob("*.jsonl.gz")):
        name = path.name.split(".")[0]
        if name in report or (subsets and name not in subsets):
            continue
        with gzip.open(path, "rt") as f:
            total = sum(1 for _ in f)
        total = min(total, limit) if limit else total
        after, before, narrowed = _empty_counts(), _empty_counts(), 0
        by_backend = collections.defaultdict(_empty_counts)
        reasons, seconds = collections.Counter(), 0.0
        start = 0
        bar = tqdm(total=total, desc=name, leave=False)
        while start < total:
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_subset_worker, args=(str(path), start, timeout_s, before_ref, child), daemon=True)
            proc.start()
            child.close()
            while True:
                try:
                    # the worker imports, loads the tokenizer and may compile the schema twice
                    msg = parent.recv() if parent.poll(timeout_s * 6 + 60) else "hung"
                except EOFError:
                    msg = "crashed"
                if msg is None:
                    start = total
                    break
                if msg in ("crashed", "hung"):
                    after["crashed"] += 1  # the schema at `start` killed or hung the worker
                    before["crashed"] += bool(before_ref)
                    by_backend["?"]["crashed"] += 1
                    start += 1
                    bar.update(1)
                    break
                i, r = msg
                if i >= total:
                    start = total
                    break
                after[r["after"]] += 1
                by_backend[r["backend"]][r["after"]] += 1
                if r["before"]:
                    before[r["before"]] += 1
                if r["reason"]:
                    reasons[r["reason"]] += 1
                narrowed += r["narrowed"]
                seconds += r["seconds"]
                start = i + 1
                bar.update(1)
                if r["after"] == "timeout":
                    # Its compile thread may still run (the server's compiler process is killed at
                    # the bound; this worker compiles in threads): a fresh worker for the rest, so
                    # that the next schemas do not wait behind it.
                    break
            proc.kill()
            proc.join()
        bar.close()
        report[name] = {"schemas": total, "after": after, "by_backend": dict(by_backend), "narrowed": narrowed,
                        "before": before if before_ref else None, "seconds": round(seconds, 2),
                        "reasons": dict(reasons.most_common())}
        if progress_path:  # keep finished subsets even if the run is stopped
            progress_path.write_text(json.dumps(report, indent=1) + "\n")
    return report


def jsonschemabench_table(report: dict) -> str:
    """The report as a Markdown table (one row per subset, then the total) and the refusals
    left, grouped by reason."""
    import collections
    cols = [("after", "served"), ("after", "refused"), ("after", "timeout"), ("after", "crashed")]
    head = ("| subset | schemas | before: served | before: refused | before: timed out | served | "
            "(xgrammar) | (llguidance) | (narrowed) | refused | timed out | crashed | refused + timed out | seconds |")
    lines = [head, "|" + "---|" * 2 + "---:|" * 12]
    tot, reasons = collections.Counter(), collections.Counter()
    for name, r in report.items():
        if not isinstance(r, dict) or "after" not in r:
            continue
        b = r.get("before") or {}
        bb = r["by_backend"]
        row = {"schemas": r["schemas"], "b_served": b.get("served", 0), "b_refused": b.get("refused", 0),
               "b_timeout": b.get("timeout", 0) + b.get("crashed", 0),
               "x": bb.get("xgrammar", {}).get("served", 0), "l": bb.get("llguidance", {}).get("served", 0),
               "narrowed": r.get("narrowed", 0), **{k: r["after"][k] for _, k in cols}, "seconds": r["seconds"]}
        tot.update(row)
        for reason, count in r["reasons"].items():
            reasons[canonical_reason(reason)] += count
        lines.append(_row(name, row))
    lines.append(_row("**total**", tot))
    out = "\n".join(lines) + "\n\nRefusals left, by reason:\n\n| reason | schemas |\n|---|---:|\n"
    out += "\n".join(f"| {k} | {v} |" for k, v in reasons.most_common())
    return out + "\n"


def canonical_reason(reason: str) -> str:
    """A stored refusal reason by the keyword llguidance refused: the places a refusal lists also
    name the siblings of a combinator (``oneOf beside type, properties``), which are not why."""
    from replicas.grammar import _CONSTRAINTS
    parts = [p for p in reason.split(", ") if p not in _CONSTRAINTS and " beside " not in p]
    if any("oneOf" in p for p in reason.split(", ")) and all(p.startswith("oneOf") for p in parts):
        return "oneOf whose members may overlap (llguidance cannot prove them disjoint)"
    return " + ".join(parts) or reason


def _row(name: str, r) -> str:
    n = r["schemas"] or 1
    bad = r["refused"] + r["timeout"] + r["crashed"]
    return (f"| {name} | {r['schemas']:,} | {r['b_served']:,} | {r['b_refused']:,} | {r['b_timeout']:,} | "
            f"{r['served']:,} | {r['x']:,} | {r['l']:,} | {r['narrowed']:,} | {r['refused']:,} | {r['timeout']:,} | {r['crashed']:,} | "
            f"{bad:,} ({100 * bad / n:.1f} %) | {r['seconds']:,.0f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.grammar_coverage", description=__doc__.split("\n\n")[0])
    ap.add_argument("suite", choices=("bfcl", "jsonschemabench"))
    ap.add_argument("--timeout-s", type=float, default=10.0, help="compile time bound per grammar")
    ap.add_argument("--limit", type=int, help="schemas per JSONSchemaBench subset")
    ap.add_argument("--json", type=Path, help="write the report as JSON (jsonschemabench: subsets already "
                    "in this file are kept, so a stopped run resumes)")
    ap.add_argument("--subsets", nargs="+", help="only these JSONSchemaBench subsets")
    ap.add_argument("--before-ref", default="main", help="jsonschemabench: also count what this git ref's "
                    "refusal rule (xgrammar only) served; '' to skip")
    ap.add_argument("--markdown", type=Path, help="jsonschemabench: write the table to this file")
    args = ap.parse_args(argv)
    if args.suite == "bfcl":
        report = bfcl_coverage(args.timeout_s)
        print(f"functions compiled: {report['functions_compiled']} / {report['functions']}")
        print(f"ground-truth calls valid (jsonschema): {report['calls_schema_valid']} / {report['calls']}")
        print(f"ground-truth calls accepted by the tool grammar: {report['calls_grammar_accepted']} / {report['calls']}")
        for f in report["failures"][:20]:
            print("failure:", json.dumps(f)[:300])
    else:
        report = jsonschemabench_coverage(args.timeout_s, args.limit, args.json, args.subsets, args.before_ref or None)
        table = jsonschemabench_table(report)
        print(table)
        if args.markdown:
            args.markdown.write_text(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
