"""Jump-forward decoding: decode steps per tool call and accuracy, with and without.

    python -m bench.jump_forward [--limit 20] [--policy full] [--budget 1.0] [--max-tokens 256]
                                 [--json PATH] [--md PATH]

Runs the synthetic test split (``--limit`` examples per category, the first ones) through the
engine twice, greedy, tools grammar (``tool_choice: auto``), once with ``enable_jump_forward``
off and once on, same prompts, same batch. Per run: tool calls parsed from the outputs, tokens
generated per call and decode steps per call (a decode step samples a token; jump-forward's
draft tokens the model then samples itself are appended without one:
``RequestMetrics.num_draft_tokens`` proposed, ``num_forced_tokens`` kept), accuracy per category
(BFCL AST rules, ``bench.accuracy.score``); between the runs: how many outputs are identical
(token ids) and how many texts are. Every number but the wall time of the generation loop is a
count: deterministic on any machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from models import chat, synth


def run(items, jump: bool, policy: str, budget: float, max_tokens: int, max_num_seqs: int) -> dict:
    """Generate every item once; per item: token ids, text, forced tokens, tool calls, score."""
    from bench.accuracy import score
    from replicas.config import EngineConfig
    from replicas.engine import LLMEngine
    from replicas.grammar import GrammarSpec
    from replicas.sampling_params import SamplingParams
    eng = LLMEngine(EngineConfig(kv_policy=policy, kv_budget=budget, max_num_seqs=max_num_seqs,
                                 enable_jump_forward=jump))
    params = SamplingParams(max_tokens=max_tokens)
    for item in items:
        ids = eng.tokenizer.apply_chat_template(item.messages, tools=item.tools, add_generation_prompt=True,
                                                return_dict=True)["input_ids"]
        eng.add_request(item.id, ids, params, GrammarSpec("tools", {"tools": item.tools, "tool_choice": "auto"}))
    outs, steps, t0 = {}, 0, time.perf_counter()
    while eng.has_unfinished():
        steps += 1
        for out in eng.step():
            if out.finished:
                outs[out.request_id] = out
    wall = time.perf_counter() - t0
    eng.close()
    per = []
    for item in items:
        out = outs[item.id]
        try:
            calls = len(chat.parse_tool_calls(out.text)[0])
        except ValueError:
            calls = 0
        per.append({"id": item.id, "category": item.category, "token_ids": out.token_ids, "text": out.text,
                    "forced": out.metrics.num_forced_tokens, "drafted": out.metrics.num_draft_tokens, "calls": calls, "correct": score(item, out.text)})
    return {"items": per, "engine_steps": steps, "jump_forward_active": eng.jump_forward, "wall_s": wall}


def summarize(r: dict) -> dict:
    per = r["items"]
    with_calls = [p for p in per if p["calls"]]
    calls = sum(p["calls"] for p in with_calls)
    tokens = sum(len(p["token_ids"]) for p in with_calls)
    forced = sum(p["forced"] for p in with_calls)
    acc: dict[str, list[bool]] = {}
    for p in per:
        acc.setdefault(p["category"], []).append(p["correct"])
    return {"calls": calls, "tokens": tokens, "forced_tokens": forced, "decode_steps": tokens - forced,
            "draft_tokens": sum(p.get("drafted", 0) for p in with_calls),
            "tokens_per_call": tokens / calls if calls else 0.0,
            "decode_steps_per_call": (tokens - forced) / calls if calls else 0.0,
            "all_tokens": sum(len(p["token_ids"]) for p in per),
            "all_decode_steps": sum(len(p["token_ids"]) - p["forced"] for p in per),
            "engine_steps": r["engine_steps"], "wall_s": r["wall_s"], "jump_forward_active": r["jump_forward_active"],
            "correct": {c: sum(v) for c, v in acc.items()}, "n": {c: len(v) for c, v in acc.items()}}


def compare(off: dict, on: dict) -> dict:
    pairs = list(zip(off["items"], on["items"]))
    return {"outputs": len(pairs),
            "identical_tokens": sum(a["token_ids"] == b["token_ids"] for a, b in pairs),
            "identical_text": sum(a["text"] == b["text"] for a, b in pairs),
            "differing_ids": [a["id"] for a, b in pairs if a["text"] != b["text"]]}


def format_table(off: dict, on: dict, cmp: dict) -> str:
    rows = [f"{'':<28} {'off':>9} {'on':>9}"]
    for key, label in (("calls", "tool calls"), ("tokens", "tokens (outputs with calls)"),
                       ("draft_tokens", "draft tokens (proposed)"),
                       ("forced_tokens", "forced tokens (no step)"), ("tokens_per_call", "tokens per call"),
                       ("decode_steps_per_call", "decode steps per call"), ("all_decode_steps", "decode steps (all)"),
                       ("engine_steps", "engine steps"), ("wall_s", "wall time (s, one run)")):
        a, b = off[key], on[key]
        rows.append(f"{label:<28} {a:>9.2f} {b:>9.2f}" if isinstance(a, float) else f"{label:<28} {a:>9} {b:>9}")
    if off["decode_steps_per_call"]:
        cut = 1 - on["decode_steps_per_call"] / off["decode_steps_per_call"]
        rows.append(f"{'decode steps per call cut':<28} {'':>9} {100 * cut:>8.1f}%")
    rows.append("")
    rows.append(f"{'category':<28} {'off':>9} {'on':>9} {'n':>4}")
    for c, n in off["n"].items():
        rows.append(f"{c:<28} {off['correct'][c]:>9} {on['correct'][c]:>9} {n:>4}")
    rows.append("")
    rows.append(f"identical outputs: {cmp['identical_tokens']} / {cmp['outputs']} (token ids), "
                f"{cmp['identical_text']} / {cmp['outputs']} (text)")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    from bench.accuracy import load_items
    from replicas.policies import POLICIES
    ap = argparse.ArgumentParser(prog="python -m bench.jump_forward", description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=20, help="examples per category (the first ones)")
    ap.add_argument("--category", action="append", choices=synth.CATEGORIES, help="default: all")
    ap.add_argument("--policy", default="full", choices=list(POLICIES))
    ap.add_argument("--budget", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.limit < 1 or args.max_tokens < 1 or not 0.0 < args.budget <= 1.0:
        ap.error("--limit and --max-tokens must be >= 1, --budget in (0, 1]")
    cats = args.category or list(synth.CATEGORIES)
    items = [i for c in cats for i in load_items("test", [c])[: args.limit]]
    res = {j: run(items, j, args.policy, args.budget, args.max_tokens, args.max_num_seqs) for j in (False, True)}
    off, on = summarize(res[False]), summarize(res[True])
    cmp = compare(res[False], res[True])
    print(f"policy {args.policy} budget {args.budget}, synthetic test split, {args.limit} per category, "
          f"greedy, max_tokens {args.max_tokens}")
    print(format_table(off, on, cmp))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"policy": args.policy, "budget": args.budget, "limit": args.limit,
                                         "max_tokens": args.max_tokens, "off": off, "on": on,
                                         "compare": cmp}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
