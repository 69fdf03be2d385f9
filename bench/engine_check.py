"""Run the engine on one device under every KV policy and check it against transformers.

    python -m bench.engine_check [--device cuda] [--prompts FILE] [--save-prompts FILE]
                                 [--max-tokens 32] [--budget 0.33] [--json PATH]

Checks, on the embedded model at float32:
- full KV: greedy tokens, up to and including EOS, equal transformers' greedy tokens (same device,
  same dtype), per prompt;
  where they differ, transformers' logit margin between the two tokens at the first difference;
- with the Triton kernels (``STRUCTKV_KERNELS=triton``; on the CPU they need ``TRITON_INTERPRET=1``)
  and with the torch references (``STRUCTKV_KERNELS=ref``): same tokens;
- every compressing policy at ``--budget`` (compilerkv alone: its prefill fraction): each request finishes, its KV ratio (bytes held / full
  KV bytes) stays at or under the budget; reported: token agreement with full KV.

The prompts are chat-templated synthetic test questions, built from ``../shared/data/bfcl``; on a
machine without that folder, pass ``--prompts`` with a file written by ``--save-prompts``.
Exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

POLICIES = ["streaming_llm", "h2o", "snapkv", "pyramidkv", "compilerkv", "pask", "compilerkv+pask"]


def build_prompts(n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from models import EMBEDDED_MODEL_DIR, synth
    tok = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    gen, out = synth.Generator("test", seed=7), []
    cats = ("simple", "multiple", "parallel", "irrelevance")
    for cat in cats:
        for ex in gen.examples(cat, -(-n // len(cats))):
            out.append(tok.apply_chat_template(ex.messages, tools=ex.tools, add_generation_prompt=True,
                                               return_dict=True)["input_ids"])
    return out[:n]


def hf_greedy(prompts, device: str, max_tokens: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    from models import EMBEDDED_MODEL_DIR
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR, dtype=torch.float32).to(device).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                               do_sample=False, pad_token_id=0)
            out.append(g[0, len(p):].tolist())  # ends at EOS, as the engine's output does
    return out


def divergence_margins(prompts, ours, theirs, device: str) -> list[float]:
    """For each prompt whose greedy tokens differ: transformers' logit of its own token minus its
    logit of ours, at the first differing position (a near-tie is a small number)."""
    import torch
    from transformers import AutoModelForCausalLM

    from models import EMBEDDED_MODEL_DIR
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR, dtype=torch.float32).to(device).eval()
    out = []
    with torch.no_grad():
        for p, a, b in zip(prompts, ours, theirs):
            if a == b:
                continue
            i = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
            logits = model(torch.tensor([p + b[:i]], device=device)).logits[0, -1].float()
            out.append(round(float(logits[b[i]] - logits[a[i]]), 5))
    return out


def run_engine(prompts, device: str, max_tokens: int, policy: str = "full", budget: float = 1.0,
               policy_args: dict | None = None, ignore_eos: bool = True):
    from replicas.config import EngineConfig
    from replicas.engine import LLMEngine
    from replicas.sampling_params import SamplingParams
    engine = LLMEngine(EngineConfig(device=device, dtype="float32", kv_cache_bytes=256 << 20, max_num_seqs=8,
                                    kv_policy=policy, kv_budget=budget, kv_policy_args=policy_args or {}))
    t0 = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos))
    wall = time.perf_counter() - t0
    return outs, wall, engine.kv.bytes_used


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.engine_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--budget", type=float, default=0.33)
    ap.add_argument("--policies", nargs="*", default=POLICIES)
    ap.add_argument("--prompts", type=Path, help="token ids (JSON) written by --save-prompts")
    ap.add_argument("--save-prompts", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    prompts = json.loads(args.prompts.read_text()) if args.prompts else build_prompts(args.num_prompts)
    if args.save_prompts:
        args.save_prompts.write_text(json.dumps(prompts))
        print(f"wrote {len(prompts)} prompts to {args.save_prompts}")
        return 0
    rows, failed = [], 0

    def record(name, fn):
        nonlocal failed
        try:
            row = fn()
        except Exception as e:  # a check that crashes is reported and counted, the others still run
            traceback.print_exc()
            row = {"check": name, "ok": False, "error": f"{type(e).__name__}: {e}"}
        row.setdefault("check", name)
        failed += not row["ok"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        return row

    state = {}

    def full(kernels_env):
        def fn():
            old = os.environ.get("STRUCTKV_KERNELS")
            os.environ["STRUCTKV_KERNELS"] = kernels_env
            try:
                outs, wall, left = run_engine(prompts, args.device, args.max_tokens, ignore_eos=False)
            finally:
                os.environ.pop("STRUCTKV_KERNELS") if old is None else os.environ.__setitem__("STRUCTKV_KERNELS", old)
            toks = [o.token_ids for o in outs]
            state[kernels_env] = toks
            same = sum(a == b for a, b in zip(toks, state["hf"]))
            row = {"ok": same == len(toks) and left == 0, "equal_to_transformers": f"{same}/{len(toks)}",
                   "wall_s": round(wall, 2), "kv_bytes_left": left}
            if same < len(toks):
                row["logit_margins_at_divergence"] = divergence_margins(prompts, toks, state["hf"], args.device)
            return row
        return fn

    def hf():
        t0 = time.perf_counter()
        state["hf"] = hf_greedy(prompts, args.device, args.max_tokens)
        return {"ok": True, "wall_s": round(time.perf_counter() - t0, 2)}

    record("transformers greedy", hf)
    if "hf" in state:
        if args.device.startswith("cuda") or os.environ.get("TRITON_INTERPRET") == "1":
            record("full KV, Triton kernels", full("triton"))
        else:
            print("note: Triton kernels skipped on the CPU without TRITON_INTERPRET=1")
        record("full KV, kernels ref", full("ref"))
    for policy in args.policies:
        def fn(policy=policy):
            # compilerkv alone compresses the prompt only: the budget is its prefill fraction.
            budget, extra = ((1.0, {"prefill_fraction": args.budget}) if policy == "compilerkv"
                             else (args.budget, None))
            outs, wall, left = run_engine(prompts, args.device, args.max_tokens, policy, budget, extra)
            ratio = max(o.metrics.kv_ratio_max for o in outs)
            ref = state.get("triton") or state.get("ref") or [[] for _ in outs]
            agree = sum(a == b for o, r in zip(outs, ref) for a, b in zip(o.token_ids, r))
            total = sum(min(len(o.token_ids), len(r)) for o, r in zip(outs, ref))
            return {"ok": all(o.finished for o in outs) and ratio <= budget + 1e-9 and left == 0,
                    "kv_ratio_max": round(ratio, 4), "token_agreement_with_full": round(agree / max(1, total), 3),  # over full KV's length
                    "wall_s": round(wall, 2)}
        record(f"{policy} @ {args.budget}", fn)
    print(f"\n{len(rows) - failed}/{len(rows)} checks passed on {args.device}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
