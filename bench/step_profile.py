"""Where one decode step's time goes: our engine's steps timed, then profiled with cProfile.

    python -m bench.step_profile [--model PATH | --random-qwen3-4b] [--batch 8] [--prompt-len 2048]
                                 [--policy full] [--budget 1.0] [--graph] [--steps 32] [--top 30]

Prefills ``--batch`` random-token prompts of ``--prompt-len`` tokens, runs a few warm-up decode
steps (the compiled graph, with ``--graph``, compiles in them), then times ``--steps`` decode steps
(CUDA synchronized: the median step in ms), then runs ``--steps`` more under cProfile and prints
the functions with the most self time and the total number of Python calls per step. On a GPU a
step far above (weight bytes + KV bytes) / bandwidth with most of its time in Python is bound by
the host.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.step_profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="HF checkpoint folder (default: the embedded model)")
    ap.add_argument("--random-qwen3-4b", action="store_true")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--policy", default="full")
    ap.add_argument("--budget", type=float, default=1.0)
    ap.add_argument("--graph", action="store_true", help="the compiled decode graph (enforce_eager=False)")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--kv-cache-gib", type=float, default=8.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    import torch

    from bench.throughput import random_qwen3_4b
    from models import resolve_checkpoint
    from replicas.config import EngineConfig
    from replicas.engine import LLMEngine
    from replicas.sampling_params import SamplingParams
    tmp = tempfile.TemporaryDirectory()
    model = str(random_qwen3_4b(Path(tmp.name)) if args.random_qwen3_4b else resolve_checkpoint(args.model))
    total = args.prompt_len + 3 * args.steps + 16
    engine = LLMEngine(EngineConfig(model=model, max_num_seqs=args.batch, max_model_len=total,
                                    kv_cache_bytes=int(args.kv_cache_gib * 2**30), kv_policy=args.policy,
                                    kv_budget=args.budget, enforce_eager=not args.graph))
    cuda = engine.kv.device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()
    rng = random.Random(0)
    vocab = engine.model.config.vocab_size
    for i in range(args.batch):
        engine.add_request(f"r{i}", [rng.randrange(10, vocab - 10) for _ in range(args.prompt_len)],
                           SamplingParams(max_tokens=total - args.prompt_len, ignore_eos=True))
    t0 = time.perf_counter()
    while len(engine.scheduler.running) < args.batch or any(not s.output_token_ids for s in engine.scheduler.running):
        engine.step()
    sync()
    prefill_s = time.perf_counter() - t0
    for _ in range(8):   # warm-up (graph compile / capture)
        engine.step()
    times = []
    for _ in range(args.steps):
        sync()
        t = time.perf_counter()
        engine.step()
        sync()
        times.append(time.perf_counter() - t)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        engine.step()
    sync()
    prof.disable()
    st = pstats.Stats(prof)
    calls = st.total_calls / args.steps
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(args.top)
    graph = engine.runner.graph
    row = {"batch": args.batch, "prompt_len": args.prompt_len, "policy": args.policy, "budget": args.budget,
           "graph": args.graph, "graph_steps": graph.calls if graph is not None else None,
           "prefill_s": round(prefill_s, 3), "step_ms_median": round(1000 * statistics.median(times), 3),
           "step_ms_min": round(1000 * min(times), 3), "python_calls_per_step": round(calls),
           "kv_bytes": engine.kv.bytes_used, "device": str(engine.kv.device)}
    print(buf.getvalue())
    print("row " + json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(row, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
