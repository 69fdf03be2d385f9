"""Requests that share one tools block: TTFT, throughput and KV bytes with the prefix cache off and on.

    python -m bench.prefix_cache [--requests 64] [--concurrency 8] [--gen 32] [--context 3000]
                                 [--policies full pask@0.33 compilerkv+pask@0.33] [--json PATH]

One synthetic long_context example (``models.synth``, test split) gives the shared part: its
tools (in the system turn, by the chat template) and its notes (the user turn up to the request):
2,500+ tokens. Each request appends a different question (the request sentence of another
long_context example), so prompts differ only in their last ~60 tokens. ``--concurrency``
closed-loop clients keep that many requests in flight (a new one is added when one finishes;
TTFT counts from its add). Every row is one engine on the embedded model, run one after the
other in this process on the same prompts, greedy, ``ignore_eos``; the rows of one run are
compared side by side (the machine may be shared: absolute times are noisy, the ratios less).

Measured: TTFT p50 / p99, output tokens per second over the run, KV bytes held at the peak
(``stats()["kv_bytes_used"]``: a shared prefix counted once, unreferenced cached pages left out)
and the cache's hit rate; whether the greedy tokens with the cache on equal those with it off;
then, with ``N`` requests with the same tools prefilled together, the KV bytes they hold against
``N`` (cache off: N copies of the prefix; on: one).
A policy the prefix cache refuses is reported as such (its error), not run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def shared_requests(num: int, context_tokens: int, seed: int = 0) -> tuple[list[list[dict]], list[dict]]:
    """``num`` chat conversations (one user turn each: one example's notes, then a different
    request) and the example's tools."""
    from models import synth
    gen = synth.Generator("test", seed=seed)
    base = gen.example("long_context", 0, context_tokens=context_tokens, depth=1.0)
    notes = base.messages[-1]["content"].split("\n\nRequest:")[0]
    conversations = []
    for i in range(1, num + 1):
        ask = gen.example("long_context", i, context_tokens=600, depth=1.0).messages[-1]["content"]
        conversations.append([{"role": "user", "content": notes + "\n\nRequest:" + ask.split("\n\nRequest:")[1]}])
    return conversations, base.tools


def shared_prompts(tokenizer, num: int, context_tokens: int, seed: int = 0) -> tuple[list[list[int]], int]:
    """The chat-templated token ids of :func:`shared_requests` and the length of their common
    prefix in tokens."""
    conversations, tools = shared_requests(num, context_tokens, seed)
    prompts = [list(tokenizer.apply_chat_template(c, tools=tools, add_generation_prompt=True,
                                                  return_dict=True)["input_ids"]) for c in conversations]
    common = 0
    while all(len(p) > common and p[common] == prompts[0][common] for p in prompts):
        common += 1
    return prompts, common


def _engine(policy: str, cache: bool, concurrency: int, kv_bytes: int):
    from replicas.config import EngineConfig
    from replicas.engine import LLMEngine
    name, _, budget = policy.partition("@")
    return LLMEngine(EngineConfig(kv_cache_bytes=kv_bytes, max_num_seqs=concurrency, kv_policy=name,
                                  kv_budget=float(budget or 1.0), enable_prefix_caching=cache))


def run(policy: str, cache: bool, prompts: list[list[int]], concurrency: int, gen: int, kv_bytes: int) -> dict:
    """Closed loop: ``concurrency`` requests in flight until all of ``prompts`` are done."""
    from replicas.sampling_params import SamplingParams
    row = {"policy": policy, "prefix_cache": cache}
    try:
        eng = _engine(policy, cache, concurrency, kv_bytes)
    except ValueError as e:
        return {**row, "refused": str(e)}
    params = SamplingParams(max_tokens=gen, ignore_eos=True)
    todo, outs, peak, peak_all = list(enumerate(prompts)), {}, 0, 0
    t0 = time.perf_counter()
    while todo or eng.has_unfinished():
        while todo and len(eng._seqs) < concurrency:
            i, p = todo.pop(0)
            eng.add_request(f"q{i}", p, params)
        for out in eng.step():
            if out.finished:
                outs[int(out.request_id[1:])] = out
        s = eng.stats()
        peak, peak_all = max(peak, s["kv_bytes_used"]), max(peak_all, eng.kv.bytes_used)
    wall = time.perf_counter() - t0
    ttft = sorted(o.metrics.ttft_s for o in outs.values())
    s = eng.stats()
    return {**row, "wall_s": wall, "ttft_p50_s": statistics.median(ttft),
            "ttft_p99_s": ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))],
            "tokens_per_s": sum(len(o.token_ids) for o in outs.values()) / wall,
            "kv_bytes_peak": peak, "kv_bytes_peak_with_idle_cache": peak_all,
            "prefix_cache_queries": s["prefix_cache_queries"], "prefix_cache_hits": s["prefix_cache_hits"],
            "prefix_cache_compressed_hits": s["prefix_cache_compressed_hits"],
            "prefix_cache_unshared_pages": s["prefix_cache_unshared_pages"],
            "tokens": [outs[i].token_ids for i in range(len(prompts))]}


def bytes_vs_n(policy: str, cache: bool, prompts: list[list[int]], ns: list[int], kv_bytes: int) -> list[dict]:
    """KV bytes held once ``n`` requests with the same tools are all prefilled, for each ``n`` of
    ``ns`` (one engine: requests are added until there are ``n``, none finishes; a warm cache:
    one request with the same tools ran before)."""
    from replicas.sampling_params import SamplingParams
    try:
        eng = _engine(policy, cache, max(ns) + 1, kv_bytes)
    except ValueError:
        return []
    eng.generate([prompts[-1]], SamplingParams(max_tokens=1))
    rows = []
    for n in sorted(ns):
        for i in range(len(eng._seqs), n):
            eng.add_request(f"n{i}", prompts[i], SamplingParams(max_tokens=64, ignore_eos=True))
        while any(not s.prefilled for s in eng._seqs.values()):
            eng.step()
        logical = sum(eng.kv.sequence_bytes(f"n{i}") for i in range(n))
        rows.append({"policy": policy, "prefix_cache": cache, "n": n, "kv_bytes_used": eng.stats()["kv_bytes_used"],
                     "sum_of_sequence_bytes": logical})
    return rows


def run_http(policy: str, cache: bool, conversations: list, tools: list, concurrency: int, gen: int,
             kv_bytes: int) -> dict:
    """The same closed loop through the OpenAI app (``cluster.openai_api``, in process over
    ASGI, no Ray): ``concurrency`` clients post ``/v1/chat/completions`` (the tools,
    ``tool_choice: "none"`` so every request generates ``gen`` tokens with ``ignore_eos``);
    end-to-end latency per request."""
    import asyncio

    import httpx

    from cluster.openai_api import OpenAIServer, build_app
    from replicas.async_engine import AsyncLLMEngine
    row = {"policy": policy, "prefix_cache": cache, "path": "http"}
    try:
        eng = _engine(policy, cache, concurrency, kv_bytes)
    except ValueError as e:
        return {**row, "refused": str(e)}
    server = OpenAIServer(AsyncLLMEngine(eng), "bench", max_pending=len(conversations) + 1)
    app, lat, tokens = build_app(server), [], [0]

    async def client(queue, c):
        while not queue.empty():
            messages = queue.get_nowait()
            t = time.perf_counter()
            r = await c.post("/v1/chat/completions", json={
                "model": "bench", "messages": messages, "tools": tools, "tool_choice": "none",
                "max_tokens": gen, "ignore_eos": True, "temperature": 0})
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
            lat.append(time.perf_counter() - t)
            tokens[0] += r.json()["usage"]["completion_tokens"]

    async def go():
        queue = asyncio.Queue()
        for m in conversations:
            queue.put_nowait(m)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench",
                                     timeout=3600) as c:
            await asyncio.gather(*(client(queue, c) for _ in range(concurrency)))
    t0 = time.perf_counter()
    try:
        asyncio.run(go())
    finally:
        server.engine.shutdown()
    wall, lat = time.perf_counter() - t0, sorted(lat)
    s = eng.stats()
    return {**row, "wall_s": wall, "latency_p50_s": statistics.median(lat),
            "latency_p99_s": lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))], "tokens_per_s": tokens[0] / wall,
            "prefix_cache_queries": s["prefix_cache_queries"], "prefix_cache_hits": s["prefix_cache_hits"]}


def pask_prefix_agreement(policy: str, prompts: list[list[int]], common: int, kv_bytes: int) -> dict:
    """Does PASK's prompt side decide the shared prefix the same way whatever follows it? For
    every prompt: its prompt labels over the prefix, the table state PASK picks, and the stored
    precision of every (prefix token, layer) (``prefill_targets``), against the first prompt's."""
    from replicas.sampling_params import SamplingParams
    eng = _engine(policy, False, 1, kv_bytes)
    ref, same = None, {"labels": 0, "table_state": 0, "targets": 0}
    for i, p in enumerate(prompts):
        eng.add_request(f"a{i}", p, SamplingParams(max_tokens=1))
        seq = eng._seqs[f"a{i}"]
        targets = eng.policy.prefill_targets(seq, eng.kv)[:common]
        got = (seq.policy_state["prompt_labels"][:common], seq.policy_state["pask_k"], targets)
        eng.abort(f"a{i}")
        ref = ref or got
        same["labels"] += got[0] == ref[0]
        same["table_state"] += got[1] == ref[1]
        same["targets"] += bool(torch.equal(got[2], ref[2]))
    return {"policy": policy, "prompts": len(prompts), "prefix_tokens": common, "same": same}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prefix_cache")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--gen", type=int, default=32, help="tokens each request generates")
    ap.add_argument("--context", type=int, default=3000, help="target tokens of the shared example")
    ap.add_argument("--policies", nargs="+", default=["full", "pask@0.33", "compilerkv+pask@0.33"])
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--kv-cache-gib", type=float, default=2.0)
    ap.add_argument("--http", action="store_true", help="only the rows through the OpenAI app (in process)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.http:
        conversations, tools = shared_requests(args.requests, args.context)
        rows = [run_http(p, c, conversations, tools, args.concurrency, args.gen, int(args.kv_cache_gib * 2**30))
                for p in args.policies for c in (False, True)]
        print(f"{args.requests} chat requests through the OpenAI app (in process, ASGI), concurrency "
              f"{args.concurrency}, {args.gen} tokens each\n")
        print("| policy | prefix cache | latency p50 (s) | latency p99 (s) | tokens/s | hit rate |")
        print("|---|---|---:|---:|---:|---:|")
        for r in rows:
            if "refused" in r:
                print(f"| {r['policy']} | {'on' if r['prefix_cache'] else 'off'} | refused |||")
                continue
            rate = r["prefix_cache_hits"] / r["prefix_cache_queries"] if r["prefix_cache_queries"] else 0.0
            print(f"| {r['policy']} | {'on' if r['prefix_cache'] else 'off'} | {r['latency_p50_s']:.2f} | "
                  f"{r['latency_p99_s']:.2f} | {r['tokens_per_s']:.1f} | {rate:.1%} |")
        if args.json:
            args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "json"},
                                             "runs": rows}, indent=1))
        return 0
    from transformers import AutoTokenizer

    from models import resolve_checkpoint
    tok = AutoTokenizer.from_pretrained(resolve_checkpoint())
    prompts, common = shared_prompts(tok, args.requests, args.context)
    kv_bytes = int(args.kv_cache_gib * 2**30)
    rows, nrows = [], []
    agree = [pask_prefix_agreement(p, prompts, common, kv_bytes) for p in args.policies if p.startswith("pask")]
    for policy in args.policies:
        for cache in (False, True):
            rows.append(run(policy, cache, prompts, args.concurrency, args.gen, kv_bytes))
            nrows += bytes_vs_n(policy, cache, prompts, args.ns, kv_bytes)
    lens = [len(p) for p in prompts]
    print(f"{args.requests} requests, prompts {min(lens)}-{max(lens)} tokens, {common} shared (tools + notes); "
          f"concurrency {args.concurrency}, {args.gen} tokens each, greedy; one engine per row, one after "
          f"the other on the same prompts\n")
    print("| policy | prefix cache | TTFT p50 (s) | TTFT p99 (s) | tokens/s | KV peak (MiB) | hit rate | "
          "compressed-prefix hit tokens | pages copied on write | same tokens as cache off |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    off = {}
    for r in rows:
        if "refused" in r:
            print(f"| {r['policy']} | {'on' if r['prefix_cache'] else 'off'} | refused: {r['refused']} |||||||")
            continue
        if not r["prefix_cache"]:
            off[r["policy"]] = r
        same = "" if not r["prefix_cache"] or r["policy"] not in off else (
            f"{sum(a == b for a, b in zip(r['tokens'], off[r['policy']]['tokens']))} of {len(prompts)}")
        rate = r["prefix_cache_hits"] / r["prefix_cache_queries"] if r["prefix_cache_queries"] else 0.0
        print(f"| {r['policy']} | {'on' if r['prefix_cache'] else 'off'} | {r['ttft_p50_s']:.3f} | "
              f"{r['ttft_p99_s']:.3f} | {r['tokens_per_s']:.1f} | {r['kv_bytes_peak'] / 2**20:.1f} | "
              f"{rate:.1%} | {r['prefix_cache_compressed_hits']} | {r['prefix_cache_unshared_pages']} | {same} |")
    for policy, r0 in off.items():
        r1 = next((r for r in rows if r["policy"] == policy and r["prefix_cache"] and "refused" not in r), None)
        if r1:
            print(f"\n{policy}: TTFT p50 {r0['ttft_p50_s'] / r1['ttft_p50_s']:.1f}x lower with the cache, "
                  f"p99 {r0['ttft_p99_s'] / r1['ttft_p99_s']:.1f}x, "
                  f"throughput {r1['tokens_per_s'] / r0['tokens_per_s']:.2f}x, "
                  f"KV peak {r1['kv_bytes_peak'] / r0['kv_bytes_peak']:.2f}x")
    if nrows:
        print("\nKV bytes held by N requests with the same tools, all prefilled (MiB; sum of what each reads "
              "in parentheses)\n")
        print("| policy | prefix cache | " + " | ".join(f"N={n}" for n in args.ns) + " |")
        print("|---|---|" + "---:|" * len(args.ns))
        for policy in args.policies:
            for cache in (False, True):
                rs = [r for r in nrows if r["policy"] == policy and r["prefix_cache"] == cache]
                if rs:
                    print(f"| {policy} | {'on' if cache else 'off'} | " + " | ".join(
                        f"{r['kv_bytes_used'] / 2**20:.1f} ({r['sum_of_sequence_bytes'] / 2**20:.1f})"
                        for r in rs) + " |")
    for a in agree:
        print(f"\n{a['policy']}, prompt side over the {a['prefix_tokens']} shared tokens, same as the first "
              f"prompt's in {a['prompts']} prompts: labels {a['same']['labels']}, table state "
              f"{a['same']['table_state']}, stored precision of every (token, layer) {a['same']['targets']}")
    if args.json:
        for r in rows:
            r.pop("tokens", None)
        args.json.write_text(json.dumps({"common_prefix_tokens": common, "prompt_tokens": lens, "args": {
            k: v for k, v in vars(args).items() if k != "json"}, "runs": rows, "bytes_vs_n": nrows,
            "pask_prefix_agreement": agree}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
