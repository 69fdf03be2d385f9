"""The serving stack as a client sees it, through the unchanged ``openai`` SDK.

    serve run serve_config.yaml &          # then:
    python -m bench.serve_sdk bfcl  [--base-url http://127.0.0.1:8000/v1] [--categories simple_python multiple]
    python -m bench.serve_sdk load  [--requests 200] [--concurrency 16] [--budgets 1.0 0.33]
    python -m bench.serve_sdk schemas [--limit N] [--concurrency 4] [--progress FILE] [--subsets ...]

``bfcl``: every question of the BFCL categories (real function definitions and questions from
``../shared/data/bfcl``) sent with ``tools=...``; counts responses that are well-formed tool calls
whose arguments validate against the tool's JSON Schema, and BFCL accuracy (AST checker).
``load``: a bounded load test on loopback: ``--requests`` chat completions with tools at
``--concurrency``, once per KV budget (1.0 = nothing compressed), reporting status codes, p50 / p99
latency and throughput.
``schemas``: JSONSchemaBench schemas (``../shared/data/jsonschemabench``, the first ``--limit`` of
each subset, or all) sent as ``response_format`` json_schema requests (16 tokens); counts 200 / 400
/ other per subset (other = any 5xx or lost connection: each is a bug) and checks that outputs that
finished (not cut by the token limit) validate against their schema. ``--progress FILE`` keeps one
line per schema and resumes; the engine replicas' process ids are logged after each subset (a
change means a replica died).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time


async def _one(client, model, messages, tools, max_tokens, kv_budget=None):
    extra = {"kv_budget": kv_budget} if kv_budget is not None else None
    t = time.perf_counter()
    try:
        r = await client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=max_tokens,
                                                 temperature=0, extra_body=extra)
        return 200, time.perf_counter() - t, r
    except Exception as e:  # openai.APIStatusError carries the HTTP status
        return getattr(e, "status_code", -1), time.perf_counter() - t, e


async def _gather(base_url, jobs, concurrency):
    """Run ``job(client)`` coroutines at ``concurrency`` with one client on this event loop (an
    AsyncOpenAI client's connections belong to the loop that opened them)."""
    from openai import AsyncOpenAI
    sem = asyncio.Semaphore(concurrency)
    async with AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600) as client:
        async def run(job):
            async with sem:
                return await job(client)
        return await asyncio.gather(*(run(j) for j in jobs))


def bfcl_run(base_url: str, model: str, categories: list[str], concurrency: int, limit: int | None) -> dict:
    import jsonschema

    from models import bfcl
    from models.checker import check
    report = {}
    for cat in categories:
        qs = [q for q in bfcl.load_questions(cat) if q.ground_truth is not None][:limit]
        tools = [[bfcl.to_openai_tool(f, q.language) for f in q.functions] for q in qs]
        jobs = [lambda c, q=q, t=t: _one(c, model, q.messages, t, 128) for q, t in zip(qs, tools)]
        t0 = time.perf_counter()
        results = asyncio.run(_gather(base_url, jobs, concurrency))
        wall = time.perf_counter() - t0
        codes, wellformed, valid, correct = {}, 0, 0, 0
        for q, t, (code, _, r) in zip(qs, tools, results):
            codes[code] = codes.get(code, 0) + 1
            if code != 200:
                continue
            calls = r.choices[0].message.tool_calls or []
            schemas = {x["function"]["name"]: x["function"]["parameters"] for x in t}
            parsed = []
            try:
                for c in calls:
                    parsed.append({"name": c.function.name, "arguments": json.loads(c.function.arguments)})
            except json.JSONDecodeError:
                continue
            if calls:
                wellformed += 1
                if all(p["name"] in schemas and _valid(jsonschema, p["arguments"], schemas[p["name"]]) for p in parsed):
                    valid += 1
            correct += check(q.functions, parsed, q.ground_truth, cat).valid
        report[cat] = {"requests": len(qs), "status": codes, "tool_calls": wellformed, "schema_valid": valid,
                       "bfcl_accuracy": correct / len(qs), "wall_s": round(wall, 1)}
        print(f"{cat}: {json.dumps(report[cat])}", flush=True)
    return report


def _valid(jsonschema, args, schema) -> bool:
    try:
        jsonschema.validate(args, schema)
        return True
    except jsonschema.ValidationError:
        return False


def load_run(base_url: str, model: str, requests: int, concurrency: int, budgets: list[float]) -> list[dict]:
    from models import synth
    gen = synth.Generator("test", seed=11)
    examples = [ex for cat in ("simple", "multiple", "parallel") for ex in gen.examples(cat, requests // 3 + 1)][:requests]
    rows = []
    for budget in budgets:
        jobs = [lambda c, ex=ex: _one(c, model, ex.messages, ex.tools, 64, budget) for ex in examples]
        t0 = time.perf_counter()
        results = asyncio.run(_gather(base_url, jobs, concurrency))
        wall = time.perf_counter() - t0
        codes = {}
        for code, _, _ in results:
            codes[code] = codes.get(code, 0) + 1
        lat = sorted(dt for code, dt, _ in results if code == 200)
        tokens = sum(r.usage.completion_tokens for code, _, r in results if code == 200)
        ratio = [r.usage.model_extra.get("kv_budget_ratio_max") for code, _, r in results if code == 200]
        row = {"kv_budget": budget, "requests": requests, "concurrency": concurrency, "status": codes,
               "p50_s": round(statistics.median(lat), 3) if lat else None,
               "p99_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3) if lat else None,
               "requests_per_s": round(len(lat) / wall, 2), "output_tokens_per_s": round(tokens / wall, 1),
               "kv_ratio_max": max(ratio) if ratio else None, "wall_s": round(wall, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _replica_pids() -> list[int]:
    """Engine replica processes on this machine (Ray sets their title): a changed set during the
    run means a replica died and was replaced."""
    try:
        import psutil
    except ImportError:
        return []
    return sorted(p.pid for p in psutil.process_iter(["cmdline"])
                  if any(":LLMServer" in a for a in (p.info["cmdline"] or [])))


def schemas_run(base_url: str, model: str, limit: int | None, concurrency: int, progress: str | None = None,
                subsets: list[str] | None = None) -> dict:
    """JSONSchemaBench schemas as response_format requests. With ``progress`` (a JSONL file), one
    line per schema is appended as it finishes and a rerun skips the schemas already there (resume)."""
    import gzip
    from pathlib import Path

    import httpx
    import jsonschema
    folder = Path(__file__).resolve().parents[2] / "shared" / "data" / "jsonschemabench" / "schemas"
    done: dict[tuple[str, int], dict] = {}
    if progress and Path(progress).exists():
        for line in Path(progress).read_text().splitlines():
            rec = json.loads(line)
            if "index" in rec:
                done[(rec["subset"], rec["index"])] = rec
    log = open(progress, "a") if progress else None

    async def go(subset, schemas):
        sem = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(base_url=base_url, timeout=600) as c:
            async def one(i, schema):
                if (subset, i) in done:
                    return
                body = {"model": model, "max_tokens": 16, "temperature": 0,
                        "messages": [{"role": "user", "content": "Answer with a JSON value."}],
                        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
                rec = {"subset": subset, "index": i}
                async with sem:
                    t = time.perf_counter()
                    try:
                        r = await c.post("/chat/completions", json=body)
                        rec["status"] = r.status_code
                    except httpx.HTTPError as e:
                        rec["status"], r = f"{type(e).__name__}", None
                    rec["seconds"] = round(time.perf_counter() - t, 2)
                if rec["status"] == 200:
                    choice = r.json()["choices"][0]
                    rec["finished"] = choice["finish_reason"] == "stop"
                    if rec["finished"]:
                        try:
                            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
                            rec["valid"] = True
                        except Exception:  # noqa: BLE001 - an invalid output or a schema jsonschema rejects
                            rec["valid"] = False
                elif r is not None:
                    try:
                        rec["message"] = r.json()["error"]["message"][:200]
                    except (ValueError, KeyError, TypeError):
                        rec["message"] = r.text[:200]
                done[(subset, i)] = rec
                if log:
                    log.write(json.dumps(rec) + "\n")
                    log.flush()
            await asyncio.gather(*(one(i, sch) for i, sch in enumerate(schemas)))

    pids_start = _replica_pids()
    for path in sorted(folder.glob("*.jsonl.gz")):
        subset = path.name.split(".")[0]
        if subsets and subset not in subsets:
            continue
        with gzip.open(path, "rt") as f:
            rows = [json.loads(line) for line in f][:limit]
        schemas = [r.get("json_schema", r.get("schema", r)) for r in rows]
        schemas = [json.loads(x) if isinstance(x, str) else x for x in schemas]
        t0 = time.perf_counter()
        asyncio.run(go(subset, schemas))
        pids = _replica_pids()
        if log:
            log.write(json.dumps({"subset": subset, "replica_pids": pids, "seconds": round(time.perf_counter() - t0, 1)})
                      + "\n")
            log.flush()
        print(subset, json.dumps(_summary([done[(subset, i)] for i in range(len(schemas)) if (subset, i) in done])),
              f"replica pids {pids} (at the start {pids_start})", flush=True)
    report = {}
    for (subset, _), rec in sorted(done.items()):
        report.setdefault(subset, []).append(rec)
    return {k: _summary(v) for k, v in report.items()}


def schemas_report(progress: str) -> str:
    """A Markdown table (per subset: sent, 200, 400, other, finished, valid) from a progress file,
    with the replica process ids logged after each subset and any notes in it."""
    from pathlib import Path
    recs, notes, pids = {}, [], []
    for line in Path(progress).read_text().splitlines():
        r = json.loads(line)
        if "index" in r:
            recs[(r["subset"], r["index"])] = r
        elif "replica_pids" in r:
            pids.append(f"{r['subset']}: {r['replica_pids']}")
        else:
            notes.append(r.get("note", json.dumps(r)))
    by: dict[str, list] = {}
    for (subset, _), r in sorted(recs.items()):
        by.setdefault(subset, []).append(r)
    rows = ["| subset | sent | 200 | 400 | other (5xx, lost) | finished in 16 tokens | of those schema-valid |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    total = _summary([r for v in by.values() for r in v])
    for subset, v in by.items():
        s = _summary(v)
        rows.append(f"| {subset} | {s['schemas']} | {s['200']} | {s['400']} | {s['other']} | {s['finished']} | "
                    f"{s['finished_valid']} |")
    rows.append(f"| **all** | {total['schemas']} | {total['200']} | {total['400']} | {total['other']} | "
                f"{total['finished']} | {total['finished_valid']} |")
    out = rows + ["", "Engine replica process ids after each subset: " + "; ".join(pids)]
    if notes:
        out += ["", "Notes in the log: " + "; ".join(notes)]
    if total["other_examples"]:
        out += ["", "Other (first 10): " + json.dumps(total["other_examples"][:10])]
    return "\n".join(out) + "\n"


def _summary(recs: list[dict]) -> dict:
    s = {"schemas": len(recs), "200": 0, "400": 0, "other": 0, "finished": 0, "finished_valid": 0,
         "seconds_sum": round(sum(r.get("seconds", 0) for r in recs), 1), "other_examples": []}
    for r in recs:
        if r["status"] == 200:
            s["200"] += 1
            s["finished"] += bool(r.get("finished"))
            s["finished_valid"] += bool(r.get("valid"))
        elif r["status"] == 400:
            s["400"] += 1
        else:
            s["other"] += 1
            s["other_examples"].append({"index": r["index"], "status": r["status"], "message": r.get("message")})
    return s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve_sdk", description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("bfcl", "load", "schemas", "schemas-report"))
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default="qwen3-fc-6m")
    ap.add_argument("--categories", nargs="+", default=["simple_python", "multiple"])
    ap.add_argument("--limit", type=int)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--budgets", nargs="+", type=float, default=[1.0, 0.33])
    ap.add_argument("--progress", help="schemas: JSONL of per-schema results, appended; a rerun resumes")
    ap.add_argument("--subsets", nargs="+", help="schemas: only these JSONSchemaBench subsets")
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)
    if args.what == "bfcl":
        out = bfcl_run(args.base_url, args.model, args.categories, args.concurrency, args.limit)
    elif args.what == "schemas-report":
        print(schemas_report(args.progress), end="")
        return 0
    elif args.what == "schemas":
        out = schemas_run(args.base_url, args.model, args.limit, args.concurrency, args.progress, args.subsets)
    else:
        out = load_run(args.base_url, args.model, args.requests, args.concurrency, args.budgets)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
