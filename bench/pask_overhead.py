"""PASK's run-time cost per generated token, as a share of the inter-token latency.

    python -m bench.pask_overhead [--batch 1 8] [--max-tokens 96] [--pask-table DIR] [--repeats 3]

Runs synthetic test prompts (tools grammar, greedy) through the engine with the PASK policy and
times, per decode step, (a) tagging: the new token's text (decoded once per token id) and the
structural tagger's ``feed_bucket``, (b) lookup: the policy's ``decode_targets`` (table
row -> each new token's precision per layer), and (c) the engine's budget check with the budget
state's ``hold_budget`` (KV work, reported apart; the store itself is part of the forward). ITL is the engine step time while every sequence decodes. Prints medians over repeats.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


class _Timer:
    def __init__(self):
        self.total = 0.0

    def wrap(self, fn):
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.total += time.perf_counter() - t
        return timed


def measure(batch: int, max_tokens: int, table: str | None, seed: int = 0) -> dict:
    from models import synth
    from replicas import engine as engine_mod
    from replicas.config import EngineConfig
    from replicas.engine import LLMEngine
    from replicas.grammar import GrammarSpec
    from replicas.policies.pask import PASKPolicy
    from replicas.sampling_params import SamplingParams
    from replicas.tagger import StructuralTagger

    eng = LLMEngine(EngineConfig(kv_policy="pask", kv_policy_args={"table": table} if table else {},
                                 kv_budget=0.5, max_num_seqs=batch, kv_cache_bytes=256 << 20))
    tag, lookup, apply = _Timer(), _Timer(), _Timer()
    feed, targets, missing = StructuralTagger.feed_bucket, PASKPolicy.decode_targets, engine_mod.TokenText.__missing__
    enforce = eng._enforce_budget
    StructuralTagger.feed_bucket = tag.wrap(feed)
    engine_mod.TokenText.__missing__ = tag.wrap(missing)   # a token's text, decoded once per id
    PASKPolicy.decode_targets = lookup.wrap(targets)
    try:
        gen = synth.Generator("test", seed=seed)
        examples = [ex for cat in ("simple", "multiple", "parallel", "parallel_multiple")
                    for ex in gen.examples(cat, batch)][:batch]
        for i, ex in enumerate(examples):
            ids = eng.tokenizer.apply_chat_template(ex.messages, tools=ex.tools, add_generation_prompt=True,
                                                    return_dict=True)["input_ids"]
            eng.add_request(f"r{i}", ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                            GrammarSpec("tools", {"tools": ex.tools, "tool_choice": "required"}))
        steps, tokens = [], 0
        while eng.has_unfinished():
            tag.total = lookup.total = apply.total = 0.0
            eng._enforce_budget = apply.wrap(enforce)
            t = time.perf_counter()
            outs = eng.step()
            dt = time.perf_counter() - t
            eng._enforce_budget = enforce
            if len(outs) == batch and all(o.num_output_tokens > 1 for o in outs):  # pure decode steps
                steps.append((dt, tag.total, lookup.total, apply.total))
                tokens += len(outs)
        eng.close()
    finally:
        StructuralTagger.feed_bucket, PASKPolicy.decode_targets = feed, targets
        engine_mod.TokenText.__missing__ = missing
    med = lambda i: statistics.median(s[i] for s in steps)
    itl = med(0)
    return {"batch": batch, "decode_steps": len(steps), "itl_ms": 1e3 * itl,
            "tag_ms_per_step": 1e3 * med(1), "lookup_ms_per_step": 1e3 * med(2),
            "apply_ms_per_step": 1e3 * med(3),
            "tag_lookup_share": (med(1) + med(2)) / itl}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pask_overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--pask-table", type=Path)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    print(f"{'batch':>5} {'ITL ms':>8} {'tag ms':>8} {'lookup ms':>10} {'apply ms':>9} {'tag+lookup / ITL':>17}")
    for b in args.batch:
        runs = [measure(b, args.max_tokens, str(args.pask_table) if args.pask_table else None, seed=r)
                for r in range(args.repeats)]
        m = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"{b:>5} {m['itl_ms']:>8.2f} {m['tag_ms_per_step']:>8.3f} {m['lookup_ms_per_step']:>10.3f} "
              f"{m['apply_ms_per_step']:>9.3f} {100 * m['tag_lookup_share']:>16.2f}%", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
