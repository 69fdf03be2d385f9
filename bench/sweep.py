"""Accuracy versus total KV budget for every policy, through the same harness.

    python -m bench.sweep [--policies P ...] [--budgets 1.0 0.5 0.33 0.25 0.15] [--split test]
                          [--category C ...] [--limit N] [--out docs/results] [--name sweep]
    python -m bench.sweep --prefill-tokens 256 512 1024 --category long_context \
        --policies full compilerkv snapkv pyramidkv h2o streaming_llm --name prefill_sweep

Runs ``bench.accuracy`` for each (policy, budget) (full KV only at 1.0; greedy, tools grammar on
unless ``--no-grammar``) and writes
``<name>.md`` (table), ``<name>.json`` and ``<name>.png`` (accuracy vs budget, one line per
policy) under ``--out``. Each row also gives the achieved budget ratio (mean and max over requests),
which the engine holds at or below the requested budget. With ``--prefill-tokens`` the budgets are
prompt tokens kept per layer instead (generated tokens all kept; ``bench.accuracy``'s
``--prefill-tokens``). ``VARIANTS`` adds the ablations as policy names (CompilerKV without its
head table, without its gate, at pooling width 5; SnapKV at pooling width 21).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

from bench import accuracy
from replicas.errors import InvalidRequestError
from replicas.policies import POLICIES

BUDGETS = (1.0, 0.5, 0.33, 0.25, 0.15)
# Ablations, run like policies: name -> (policy, policy arguments).
# The pooling-width rows: CompilerKV at SnapKV's default width (5), SnapKV at CompilerKV's (21).
VARIANTS = {"compilerkv-no-head-table": ("compilerkv", {"use_head_weights": False}),
            "compilerkv-no-gate": ("compilerkv", {"use_gate": False}),
            "compilerkv-kernel5": ("compilerkv", {"kernel": 5}),
            "snapkv-kernel21": ("snapkv", {"kernel_size": 21})}
CHOICES = (*POLICIES, *VARIANTS)


def resolve(name: str) -> tuple[str, dict]:
    return VARIANTS[name] if name in VARIANTS else (name, {})


def without_prefill_tokens(policies: list[str]) -> list[str]:
    """The policies (or variants) that cannot take a prefill-token budget (full KV needs none)."""
    return [p for p in policies if p != "full" and resolve(p)[0] not in accuracy.PREFILL_POLICIES]


def run(policies, budgets, split, categories, limit, model=None, grammar=True, pask_table=None,
        prefill_tokens=None, max_tokens=256, on_row=None) -> list[dict]:
    """One row per (policy, budget); with ``prefill_tokens`` (a list), per (policy, prompt tokens
    kept per layer) at total budget 1.0. Full KV gives one row. ``on_row(rows)`` is called after
    each row (the CLI writes the files then, so a stopped sweep keeps what it measured)."""
    if prefill_tokens and without_prefill_tokens(policies):
        raise ValueError(f"--prefill-tokens applies to {', '.join(accuracy.PREFILL_POLICIES)}; "
                         f"not to {without_prefill_tokens(policies)}")
    rows = []
    items = accuracy.load_items(split, categories)
    if limit:
        items = [i for c in categories for i in [x for x in items if x.category == c][:limit]]
    for name in policies:
        policy, variant_args = resolve(name)
        points = [None] if policy == "full" else (prefill_tokens or budgets)
        for point in points:
            budget = 1.0 if prefill_tokens or point is None else point
            args = {"table": str(pask_table)} if policy == "pask" and pask_table else {}
            args.update(variant_args)
            if prefill_tokens and point is not None:
                args["prefill_tokens"] = point
            label = f"{name} {'prefill tokens' if prefill_tokens else 'budget'} {point or 1.0}"
            # A policy that refuses the budget is a skipped row: the engine refuses it when built
            # (ValueError), or per request (InvalidRequestError); any other failure is a bug and raises.
            try:
                runner = accuracy.EngineRunner(accuracy.resolve_checkpoint(model), policy, budget, grammar,
                                               max_tokens, max_num_seqs=len(items), policy_args=args)
            except ValueError as e:
                print(f"{label:<40} skipped: {type(e).__name__}: {e}", flush=True)
                continue
            try:
                summary = accuracy.report(accuracy.evaluate(runner, items, True, label), name, budget, split)
            except InvalidRequestError as e:
                print(f"{label:<40} skipped: {type(e).__name__}: {e}", flush=True)
                continue
            if prefill_tokens:
                summary["prefill_tokens"] = point
            summary.update(runner.kv_ratio_summary())
            print(f"{label:<40} overall {100 * summary['overall']:.1f}%  "
                  f"ratio mean {summary['kv_ratio_mean']:.3f} max {summary['kv_ratio_max']:.3f}", flush=True)
            rows.append(summary)
            if on_row:
                on_row(rows)
    return rows


def write(rows: list[dict], out: Path, categories: list[str], name: str = "sweep") -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(rows, indent=1) + "\n")
    prefill = any("prefill_tokens" in r for r in rows)
    x_key, x_name = ("prefill_tokens", "prefill tokens") if prefill else ("budget", "budget")
    head = f"| policy | {x_name} | " + " | ".join(categories) + " | overall | ratio mean | ratio max |"
    lines = [head, "|" + "---|" * (len(categories) + 5)]
    for r in rows:
        cells = " | ".join(f"{100 * r['accuracy'][c]:.1f}" for c in categories)
        lines.append(f"| {r['policy']} | {r.get(x_key, 'all')} | {cells} | {100 * r['overall']:.1f} | "
                     f"{r['kv_ratio_mean']:.3f} | {r['kv_ratio_max']:.3f} |")
    n = rows[0]["num_examples"] if rows else {}
    what = "prompt tokens kept per layer (generated tokens all kept)" if prefill else "total KV budget"
    (out / f"{name}.md").write_text(f"Accuracy (%) by {what}; examples per category: {n}\n\n"
                                    + "\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    full = [r for r in rows if r["policy"] == "full"]
    for policy in dict.fromkeys(r["policy"] for r in rows if r["policy"] != "full"):
        pts = sorted((r[x_key], 100 * r["overall"]) for r in rows if r["policy"] == policy)
        ax.plot(*zip(*pts), marker="o", label=policy)
    if full:
        ax.axhline(100 * full[0]["overall"], color="black", linestyle="--", label="full KV")
    if prefill:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens kept per layer")
    else:
        ax.set_xlabel("total KV budget (bytes held / full KV bytes)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(textwrap.fill(f"Function-calling accuracy vs {what}", 60), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", nargs="+", choices=list(CHOICES),
                    help="default: every policy (with --prefill-tokens: full and the prompt-scoring ones)")
    ap.add_argument("--budgets", nargs="+", type=float, help=f"total KV budgets (default {' '.join(map(str, BUDGETS))})")
    ap.add_argument("--split", default="test", choices=("dev", "test"))
    ap.add_argument("--category", nargs="+", default=list(accuracy.synth.CATEGORIES))
    ap.add_argument("--limit", type=int, help="examples per category")
    ap.add_argument("--model", type=Path)
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    ap.add_argument("--no-grammar", action="store_true", help="decode without the tools grammar "
                    "(PASK's structural tags then come from the lexer alone)")
    ap.add_argument("--pask-table", type=Path, help="PASK table folder (default: shipped for the model)")
    ap.add_argument("--prefill-tokens", nargs="+", type=int,
                    help="prompt tokens kept per layer (instead of --budgets; total budget 1.0)")
    ap.add_argument("--name", default="sweep", help="stem of the output files")
    ap.add_argument("--max-tokens", type=int, default=256, help="generated tokens per answer at most")
    args = ap.parse_args(argv)
    budgets_given = args.budgets is not None
    args.budgets = args.budgets if budgets_given else list(BUDGETS)
    bad = [b for b in args.budgets if not 0.0 < b <= 1.0]
    if bad:
        ap.error(f"budgets must be in (0, 1]: {bad}")
    if args.policies is None:
        args.policies = ["full", *accuracy.PREFILL_POLICIES] if args.prefill_tokens else list(POLICIES)
    if args.max_tokens < 1:
        ap.error("--max-tokens must be at least 1")
    if args.limit is not None and args.limit < 1:
        ap.error("--limit must be at least 1")
    if args.prefill_tokens and budgets_given:
        ap.error("--budgets and --prefill-tokens exclude each other: a prefill-token sweep runs at total budget 1.0")
    if args.prefill_tokens:
        if min(args.prefill_tokens) < 1:
            ap.error(f"--prefill-tokens must be positive: {args.prefill_tokens}")
        if without_prefill_tokens(args.policies):
            ap.error(f"--prefill-tokens applies to {', '.join(accuracy.PREFILL_POLICIES)}, "
                     f"not to {without_prefill_tokens(args.policies)}")
    unknown = [c for c in args.category if c not in accuracy.synth.CATEGORIES]
    if unknown:
        ap.error(f"unknown categories {unknown}; choose from {', '.join(accuracy.synth.CATEGORIES)}")
    rows = run(args.policies, args.budgets, args.split, args.category, args.limit, args.model,
               not args.no_grammar, args.pask_table, args.prefill_tokens, args.max_tokens,
               on_row=lambda rows: write(rows, args.out, args.category, args.name))
    write(rows, args.out, args.category, args.name)
    print(f"wrote {args.out / (args.name + '.md')}, {args.name}.json, {args.name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
