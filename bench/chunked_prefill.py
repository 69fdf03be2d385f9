"""Running streams while long prompts arrive: inter-token latency with and without chunked prefill.

    python -m bench.chunked_prefill [--streams 4] [--arrivals 4] [--prompt-len 3840]
                                    [--chunks 0 512 1024 2048] [--policy full] [--json PATH]

``--streams`` requests (short synthetic test prompts) decode; every ``--every`` steps one of
``--arrivals`` long requests (synthetic long_context prompts of about ``--prompt-len`` tokens,
16 generated tokens) arrives. Each row is one engine on the embedded model: chunk 0 = whole-prompt
prefill (the default), else ``enable_chunked_prefill`` with ``max_num_batched_tokens`` = chunk.
Measured on the streams: inter-token latency (time between two of a stream's tokens) p50 / p99 /
max in ms, and the longest gap in decode steps the streams lost; on the long requests: TTFT p50;
and the wall time of the whole run. Prompts are the same in every row; greedy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def run(chunk: int, streams: list[list[int]], longs: list[list[int]], every: int, gen: int,
        policy: str, budget: float) -> dict:
    from replicas.config import EngineConfig
    from replicas.engine import LLMEngine
    from replicas.sampling_params import SamplingParams
    cfg = dict(kv_cache_bytes=2 << 30, max_num_seqs=len(streams) + len(longs), kv_policy=policy, kv_budget=budget)
    if chunk:
        cfg.update(enable_chunked_prefill=True, max_num_batched_tokens=chunk)
    eng = LLMEngine(EngineConfig(**cfg))
    for i, p in enumerate(streams):
        eng.add_request(f"s{i}", p, SamplingParams(max_tokens=gen, ignore_eos=True))
    while any(not s.prefilled for s in eng._seqs.values()):
        eng.step()
    last_t = {f"s{i}": time.perf_counter() for i in range(len(streams))}
    last_step = dict.fromkeys(last_t, 0)
    gaps, step_gaps, arrived, ttft = [], [], {}, []
    t0, step = time.perf_counter(), 0
    while eng.has_unfinished():
        if step % every == 0 and len(arrived) < len(longs):
            rid = f"l{len(arrived)}"
            eng.add_request(rid, longs[len(arrived)], SamplingParams(max_tokens=16, ignore_eos=True))
            arrived[rid] = time.perf_counter()
        outs = eng.step()
        step += 1
        now = time.perf_counter()
        for out in outs:
            rid = out.request_id
            if rid in last_t:
                gaps.append(now - last_t[rid])
                step_gaps.append(step - last_step[rid])
                last_t[rid], last_step[rid] = now, step
            if rid in arrived and out.num_output_tokens == 1:
                ttft.append(now - arrived[rid])
            if out.finished:
                last_t.pop(rid, None)
    wall = time.perf_counter() - t0
    gaps.sort()
    q = lambda p: gaps[min(len(gaps) - 1, int(p * len(gaps)))] * 1000  # noqa: E731
    return {"chunk": chunk, "itl_p50_ms": q(0.5), "itl_p99_ms": q(0.99), "itl_max_ms": gaps[-1] * 1000,
            "max_steps_between_tokens": max(step_gaps), "long_ttft_p50_s": statistics.median(ttft),
            "wall_s": wall, "steps": step}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.chunked_prefill")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--arrivals", type=int, default=4)
    ap.add_argument("--every", type=int, default=24, help="decode steps between two arrivals")
    ap.add_argument("--prompt-len", type=int, default=3840)
    ap.add_argument("--gen", type=int, default=160, help="tokens each stream generates")
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 512, 1024, 2048])
    ap.add_argument("--policy", default="full", help="name@budget, e.g. snapkv@0.33")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from bench.throughput import real_prompts
    from models import resolve_checkpoint
    tok = AutoTokenizer.from_pretrained(resolve_checkpoint())
    streams = real_prompts(tok, 512, args.streams, seed=3)
    longs = real_prompts(tok, args.prompt_len, args.arrivals, seed=4)
    name, _, budget = args.policy.partition("@")
    rows = [run(c, streams, longs, args.every, args.gen, name, float(budget or 1.0)) for c in args.chunks]
    print(f"{args.streams} streams decoding {args.gen} tokens; {args.arrivals} prompts of "
          f"{statistics.mean(map(len, longs)):.0f} tokens arrive every {args.every} steps; policy {args.policy}\n")
    print("| prefill | ITL p50 (ms) | ITL p99 (ms) | ITL max (ms) | most steps between two tokens | long TTFT p50 (s) | wall (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        label = "whole prompt" if not r["chunk"] else f"chunks of {r['chunk']}"
        print(f"| {label} | {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | {r['itl_max_ms']:.1f} | "
              f"{r['max_steps_between_tokens']} | {r['long_ttft_p50_s']:.2f} | {r['wall_s']:.1f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
