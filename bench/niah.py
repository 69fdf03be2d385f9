"""Needle in a haystack: accuracy by prompt length and needle depth, per KV policy.

    python -m bench.niah [--lengths 2000 2500 3000 3500] [--depths 0 0.25 0.5 0.75 1]
                         [--per-cell 4] [--policies full compilerkv snapkv] [--prefill-tokens 512]
                         [--split test] [--out docs/results] [--name niah]

The needle is the request of a synthetic ``long_context`` example (``models.synth``): one
function call whose argument values are stated only there, planted as its own paragraph at a
relative depth of the user's notes (0 = first paragraph, 1 = last), after a tool list of 7-13
functions (unseen ones on the test split). The answer must name the function and copy the
values: a cell's score is the share of answers the BFCL AST checker accepts. The same example
index gives the same tools, call and filler at every depth, so a row differs only in where the
needle sits. Compressing policies keep ``--prefill-tokens`` prompt tokens per layer (every
generated token kept), as ``bench.sweep --prefill-tokens``. Decoding is greedy under the tools
grammar. Writes ``<name>.json``, ``<name>.md`` (one table per policy, with the measured prompt
lengths) and ``<name>.png`` (one heat map per policy).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench import accuracy
from models import CheckpointNotFoundError, synth

LENGTHS = (2000, 2500, 3000, 3500)  # the tool lists alone take up to ~2,000 tokens
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
FIRST_INDEX = 10_000  # past the fixed evaluation sets, so the needles are new examples


def needle_items(split: str, lengths, depths, per_cell: int) -> list[accuracy.Item]:
    """``per_cell`` long-context items for every (length, depth); ids ``niah_<len>_<depth>_<i>``."""
    gen = synth.Generator(split)
    items = []
    for length in lengths:
        for depth in depths:
            for i in range(per_cell):
                ex = gen.example("long_context", FIRST_INDEX + i, context_tokens=length, depth=depth)
                items.append(accuracy.Item(f"niah_{length}_{depth}_{i}", "long_context", ex.messages,
                                           ex.tools, ex.tools, ex.ground_truth))
    return items


def prompt_lengths(model_dir: Path, items: list[accuracy.Item]) -> list[int]:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    return [len(tok.apply_chat_template(i.messages, tools=i.tools, add_generation_prompt=True,
                                        return_dict=True)["input_ids"]) for i in items]


def run(policies, lengths, depths, per_cell, prefill_tokens, split="test", model=None,
        max_tokens=256) -> dict:
    """The grid of every policy (see the module docstring).

    Raises:
        ValueError: a prompt plus ``max_tokens`` does not fit the model's context (before any work).
    """
    items = needle_items(split, lengths, depths, per_cell)
    model_dir = accuracy.resolve_checkpoint(model)
    sizes = prompt_lengths(model_dir, items)
    context = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings", 4096)
    if max(sizes) + max_tokens > context:
        raise ValueError(f"the longest needle prompt has {max(sizes)} tokens; with --max-tokens {max_tokens} it "
                         f"does not fit the model's {context}-token context: lower --lengths or --max-tokens")
    out = {"lengths": list(lengths), "depths": list(depths), "per_cell": per_cell,
           "prefill_tokens": prefill_tokens, "split": split, "policies": {},
           "prompt_tokens": {str(n): sizes[i * len(depths) * per_cell:(i + 1) * len(depths) * per_cell]
                             for i, n in enumerate(lengths)}}
    for policy in policies:
        args = {} if policy == "full" else {"prefill_tokens": prefill_tokens}
        runner = accuracy.EngineRunner(model_dir, policy, 1.0, True, max_tokens, max_num_seqs=16,
                                       policy_args=args)
        texts = runner.run_all(items, desc=policy)
        ok = {i.id: accuracy.score(i, t) for i, t in zip(items, texts)}
        grid = [[sum(ok[f"niah_{n}_{d}_{i}"] for i in range(per_cell)) / per_cell for n in lengths]
                for d in depths]
        out["policies"][policy] = {"grid": grid, "overall": sum(map(sum, grid)) / (len(depths) * len(lengths)),
                                   **runner.kv_ratio_summary()}
        print(f"{policy:<16} overall {100 * out['policies'][policy]['overall']:.1f}%  "
              f"kv ratio mean {out['policies'][policy]['kv_ratio_mean']:.3f}", flush=True)
    return out


def write(result: dict, out: Path, name: str = "niah") -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    lengths, depths = result["lengths"], result["depths"]
    measured = [sorted(result["prompt_tokens"][str(n)]) for n in lengths]
    lines = [f"Needle in a haystack ({result['split']} split, {result['per_cell']} needles per cell, "
             f"compressing policies at {result['prefill_tokens']} prompt tokens per layer): accuracy (%) "
             "by prompt length (columns; target tokens, measured median in brackets) and needle depth "
             "in the notes (rows)."]
    for policy, r in result["policies"].items():
        lines += ["", f"**{policy}** (overall {100 * r['overall']:.1f} %, KV ratio mean "
                      f"{r['kv_ratio_mean']:.3f}, max {r['kv_ratio_max']:.3f})", "",
                  "| depth | " + " | ".join(f"{n} ({m[len(m) // 2]})" for n, m in zip(lengths, measured)) + " |",
                  "|---|" + "---:|" * len(lengths)]
        for d, row in zip(depths, r["grid"]):
            lines.append(f"| {d} | " + " | ".join(f"{100 * v:.0f}" for v in row) + " |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    policies = list(result["policies"])
    fig, axes = plt.subplots(1, len(policies), figsize=(4.2 * len(policies), 3.8), squeeze=False)
    for ax, policy in zip(axes[0], policies):
        grid = [[100 * v for v in row] for row in result["policies"][policy]["grid"]]
        im = ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
        for y, row in enumerate(grid):
            for x, v in enumerate(row):
                ax.text(x, y, f"{v:.0f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [str(d) for d in depths])
        ax.set_xlabel("prompt tokens (target)")
        ax.set_ylabel("needle depth in the notes")
        title = policy if policy == "full" else f"{policy} @ {result['prefill_tokens']}"
        ax.set_title(f"{title}: {100 * result['policies'][policy]['overall']:.0f} %")
    fig.colorbar(im, ax=axes[0].tolist(), label="accuracy (%)")
    fig.savefig(out / f"{name}.png", dpi=120, bbox_inches="tight")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.niah", description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", nargs="+", type=int, default=list(LENGTHS))
    ap.add_argument("--depths", nargs="+", type=float, default=list(DEPTHS))
    ap.add_argument("--per-cell", type=int, default=4)
    ap.add_argument("--policies", nargs="+", default=["full", "compilerkv", "snapkv"],
                    choices=["full", *accuracy.PREFILL_POLICIES])
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--split", default="test", choices=("dev", "test"))
    ap.add_argument("--model", type=Path)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    ap.add_argument("--name", default="niah")
    args = ap.parse_args(argv)
    args.lengths, args.depths = sorted(set(args.lengths)), sorted(set(args.depths))
    if any(not 0.0 <= d <= 1.0 for d in args.depths):
        ap.error(f"--depths must be in [0, 1]: {args.depths}")
    if any(n < 200 or n > 3800 for n in args.lengths):
        ap.error(f"--lengths must be in [200, 3800] tokens (the model's context is 4,096): {args.lengths}")
    if args.per_cell < 1 or args.prefill_tokens < 1 or args.max_tokens < 1:
        ap.error("--per-cell, --prefill-tokens and --max-tokens must be at least 1")
    try:
        result = run(args.policies, args.lengths, args.depths, args.per_cell, args.prefill_tokens, args.split,
                     args.model, args.max_tokens)
    except (ValueError, CheckpointNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write(result, args.out, args.name)
    print(f"wrote {args.out / (args.name + '.md')}, {args.name}.json, {args.name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
