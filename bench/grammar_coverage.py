"""Grammar coverage on real schemas.

    python -m bench.grammar_coverage bfcl            # BFCL functions and ground-truth calls
    python -m bench.grammar_coverage jsonschemabench [--limit N] [--timeout-s S]

``bfcl``: every BFCL function definition converts to JSON Schema and compiles as a tool grammar;
every ground-truth call (first allowed value of each parameter) validates against its schema with
``jsonschema`` and is accepted token by token, then EOS, by the question's compiled tool grammar.

``jsonschemabench``: every schema of JSONSchemaBench either compiles or raises
``GrammarCompileError`` within the time bound; reports compiled / refused / timed out and time per
subset. Each subset runs in a child process, so a crash inside the compiler is counted and the run
goes on.
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


def _subset_worker(path: str, start: int, timeout_s: float, conn) -> None:
    from replicas.errors import GrammarCompileError
    from replicas.grammar import GrammarSpec
    _, compiler = _compiler(timeout_s)
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    for i in range(start, len(rows)):
        schema = rows[i].get("json_schema", rows[i].get("schema", rows[i]))
        t0 = time.perf_counter()
        try:
            compiler.compile(GrammarSpec("json_schema", schema))
            status = "compiled"
        except GrammarCompileError as e:
            status = "timeout" if "did not compile within" in str(e) else "refused"
        conn.send((i, status, time.perf_counter() - t0))
    conn.send(None)


def jsonschemabench_coverage(timeout_s: float, limit: int | None, progress_path: Path | None = None,
                             subsets: list[str] | None = None) -> dict:
    """Per subset: compiled / refused / timeout / crashed counts and compile seconds. Subsets
    already in ``progress_path`` (a stopped run's report) are kept and not rerun."""
    report = json.loads(progress_path.read_text()) if progress_path and progress_path.is_file() else {}
    ctx = mp.get_context("spawn")
    for path in sorted(JSONSCHEMABENCH_DIR.glob("*.jsonl.gz")):
        name = path.name.split(".")[0]
        if name in report or (subsets and name not in subsets):
            continue
        with gzip.open(path, "rt") as f:
            total = sum(1 for _ in f)
        total = min(total, limit) if limit else total
        counts = {"compiled": 0, "refused": 0, "timeout": 0, "crashed": 0, "seconds": 0.0}
        start = 0
        bar = tqdm(total=total, desc=path.name.split(".")[0], leave=False)
        while start < total:
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_subset_worker, args=(str(path), start, timeout_s, child), daemon=True)
            proc.start()
            child.close()
            while True:
                try:
                    msg = parent.recv() if parent.poll(timeout_s * 3 + 60) else "hung"
                except EOFError:
                    msg = "crashed"
                if msg is None:
                    start = total
                    break
                if msg in ("crashed", "hung"):
                    counts["crashed"] += 1  # the schema at `start` killed or hung the worker
                    start += 1
                    bar.update(1)
                    break
                i, status, seconds = msg
                if i >= total:
                    start = total
                    break
                counts[status] += 1
                counts["seconds"] += seconds
                start = i + 1
                bar.update(1)
            proc.kill()
            proc.join()
        bar.close()
        counts["seconds"] = round(counts["seconds"], 2)
        report[path.name.split(".")[0]] = counts
        if progress_path:  # keep finished subsets even if the run is stopped
            progress_path.write_text(json.dumps(report, indent=1) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.grammar_coverage", description=__doc__.split("\n\n")[0])
    ap.add_argument("suite", choices=("bfcl", "jsonschemabench"))
    ap.add_argument("--timeout-s", type=float, default=10.0, help="compile time bound per grammar")
    ap.add_argument("--limit", type=int, help="schemas per JSONSchemaBench subset")
    ap.add_argument("--json", type=Path, help="write the report as JSON (jsonschemabench: subsets already "
                    "in this file are kept, so a stopped run resumes)")
    ap.add_argument("--subsets", nargs="+", help="only these JSONSchemaBench subsets")
    args = ap.parse_args(argv)
    if args.suite == "bfcl":
        report = bfcl_coverage(args.timeout_s)
        print(f"functions compiled: {report['functions_compiled']} / {report['functions']}")
        print(f"ground-truth calls valid (jsonschema): {report['calls_schema_valid']} / {report['calls']}")
        print(f"ground-truth calls accepted by the tool grammar: {report['calls_grammar_accepted']} / {report['calls']}")
        for f in report["failures"][:20]:
            print("failure:", json.dumps(f)[:300])
    else:
        report = jsonschemabench_coverage(args.timeout_s, args.limit, args.json, args.subsets)
        print(f"{'subset':<18} {'compiled':>9} {'refused':>8} {'timeout':>8} {'crashed':>8} {'seconds':>9}")
        for name, c in report.items():
            print(f"{name:<18} {c['compiled']:>9} {c['refused']:>8} {c['timeout']:>8} {c['crashed']:>8} {c['seconds']:>9.1f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
