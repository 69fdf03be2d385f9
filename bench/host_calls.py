"""Python function calls per decode step, small engine against large, per KV policy.

    python -m bench.host_calls [--policies full pask compilerkv+pask snapkv h2o streaming_llm]
                               [--budget 0.33] [--steps 32] [--json PATH]

Two random Qwen3 checkpoints of hidden size 64 (no download; the embedded tokenizer): a small
engine (batch 4, 4 layers) and a large one (batch 32, 24 layers). Each runs as many requests as
its batch, synthetic "multiple" prompts (PASK's floors refuse random tokens), waits until every
request is decoding, then counts with ``cProfile`` every Python and
built-in function call of ``--steps`` decode steps (``pstats.Stats.total_calls`` / steps).

PASK needs a table for the model's layer count: the shipped table of the embedded model (6
layers, 3 groups) with its layer groups stretched over the random model's layers, so the same
cells and upgrades apply. The table prints large / small (a step with no Python per sequence or
layer would make about the same number at both sizes) and each compressed policy against full KV
at the large size. Counts depend on the code and library versions, not on the machine's speed.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import shutil
import sys
import tempfile
from pathlib import Path

SIZES = {"small": (4, 4), "large": (32, 24)}   # name -> (batch, layers)
DEFAULT_POLICIES = ["full", "pask", "compilerkv+pask", "snapkv", "h2o", "streaming_llm"]


def random_qwen3(folder: Path, num_layers: int, seed: int = 0) -> Path:
    """A random Qwen3 of hidden size 64 (4 query / 2 KV heads of 16) with the embedded tokenizer."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from models import EMBEDDED_MODEL_DIR
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    Qwen3ForCausalLM(cfg).save_pretrained(folder)
    for f in EMBEDDED_MODEL_DIR.glob("tokenizer*"):
        shutil.copy(f, folder)
    shutil.copy(EMBEDDED_MODEL_DIR / "chat_template.jinja", folder)
    return folder


def stretched_pask_table(num_layers: int):
    """The shipped PASK table with its G layer groups spread over ``num_layers`` layers."""
    from calibration import shipped_table
    from models import EMBEDDED_MODEL_DIR
    from replicas.policies.pask import PASKTable
    table = PASKTable.load(shipped_table("pask", EMBEDDED_MODEL_DIR), EMBEDDED_MODEL_DIR)
    g = len(table.layer_groups)
    if num_layers < g:
        raise ValueError(f"a {num_layers}-layer model cannot hold the table's {g} layer groups")
    bounds = [round(i * num_layers / g) for i in range(g + 1)]
    return PASKTable(table.decode, table.prompt, list(zip(bounds[:-1], bounds[1:])))


def policy_setup(name: str, num_layers: int) -> tuple[str, dict]:
    """(engine policy name, policy arguments) for a bench policy name on a random model."""
    if name == "pask":
        return "pask", {"table": stretched_pask_table(num_layers)}
    if name == "compilerkv+pask":
        return "compilerkv+pask", {"pask_table": stretched_pask_table(num_layers)}
    return name, {}


def prompts(tokenizer, num: int) -> list[list[int]]:
    """Chat-templated synthetic prompts of the "multiple" category (tools and a question, 300-700
    tokens), whole: PASK's floors are calibrated for such prompts."""
    from models import synth
    return [list(tokenizer.apply_chat_template(ex.messages, tools=ex.tools, add_generation_prompt=True,
                                               return_dict=True)["input_ids"])
            for ex in synth.Generator("test", seed=3).examples("multiple", num)]


def count_calls(model: Path, policy: str, budget: float, batch: int, num_layers: int, steps: int,
                max_prompt_tokens: int = 2048, graph: bool = False) -> dict:
    """Calls per decode step of one engine (every request decoding for all ``steps``); ``graph``:
    the compiled decode forward (``enforce_eager=False``, compiled in the warm-up steps)."""
    from replicas.config import EngineConfig
    from replicas.engine import LLMEngine
    from replicas.sampling_params import SamplingParams
    name, args = policy_setup(policy, num_layers)
    engine = LLMEngine(EngineConfig(model=str(model), kv_policy=name, kv_policy_args=args,
                                    kv_budget=budget if name != "full" else 1.0, max_num_seqs=batch,
                                    max_model_len=max_prompt_tokens + steps + 64, kv_cache_bytes=256 << 20,
                                    enforce_eager=not graph))
    try:
        for i, ids in enumerate(prompts(engine.tokenizer, batch)):
            engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=steps + 32, ignore_eos=True))
        while engine.scheduler.waiting:
            engine.step()
        for _ in range(4):              # warm-up decode steps (first-call caches)
            engine.step()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            engine.step()
        prof.disable()
        running = len(engine.scheduler.running)
        if graph and engine.runner.graph.calls < steps:
            raise RuntimeError(f"{policy}: {engine.runner.graph.calls} of {steps + 4} decode steps ran through the graph")
        total = pstats.Stats(prof).total_calls
    finally:
        engine.close()
    if running != batch:
        raise RuntimeError(f"{policy}: {running} of {batch} requests still running after the profiled steps")
    return {"calls_per_step": total / steps, "batch": batch, "num_layers": num_layers, "graph": graph}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.host_calls", description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", nargs="+", default=DEFAULT_POLICIES)
    ap.add_argument("--budget", type=float, default=0.33)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--graph", action="store_true",
                    help="count with the compiled decode forward (enforce_eager=False); compiling a 24-layer "
                         "model takes minutes")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.steps < 1 or not 0.0 < args.budget <= 1.0:
        ap.error("--steps must be >= 1 and --budget in (0, 1]")
    import torch
    torch.set_num_threads(2)
    tmp = tempfile.TemporaryDirectory()
    models = {size: random_qwen3(Path(tmp.name) / size, layers) for size, (_, layers) in SIZES.items()}
    rows = []
    for policy in args.policies:
        row = {"policy": policy}
        for size, (batch, layers) in SIZES.items():
            counted = count_calls(models[size], policy, args.budget, batch, layers, args.steps, graph=args.graph)
            row[size], row["graph"] = counted["calls_per_step"], counted["graph"]
        rows.append(row)
        print("row " + json.dumps(row), flush=True)
    full = next((r["large"] for r in rows if r["policy"] == "full"), None)
    print(f"\ncalls per decode step, budget {args.budget}, {args.steps} steps, "
          f"{'compiled decode forward' if args.graph else 'eager'}")
    print(f"{'policy':<18} {'small (4 x 4L)':>15} {'large (32 x 24L)':>17} {'large/small':>12} {'large/full':>11}")
    for r in rows:
        vs_full = f"{r['large'] / full:.2f}" if full else "-"
        print(f"{r['policy']:<18} {r['small']:>15.0f} {r['large']:>17.0f} {r['large'] / r['small']:>12.2f} {vs_full:>11}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
