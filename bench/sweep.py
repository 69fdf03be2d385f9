"""Accuracy versus total KV budget for every policy, through the same harness.

    python -m bench.sweep [--policies P ...] [--budgets 1.0 0.5 0.33 0.25 0.15] [--split test]
                          [--category C ...] [--limit N] [--out docs/results]

Runs ``bench.accuracy`` for each (policy, budget) (full KV only at 1.0; greedy, tools grammar on
unless ``--no-grammar``) and writes
``sweep.md`` (table), ``sweep.json`` and ``sweep.png`` (accuracy vs budget, one line per policy)
under ``--out``. Each row also gives the achieved budget ratio (mean and max over requests), which
the engine holds at or below the requested budget.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench import accuracy
from replicas.errors import InvalidRequestError
from replicas.policies import POLICIES

BUDGETS = (1.0, 0.5, 0.33, 0.25, 0.15)


def run(policies, budgets, split, categories, limit, model=None, grammar=True, pask_table=None) -> list[dict]:
    rows = []
    items = accuracy.load_items(split, categories)
    if limit:
        items = [i for c in categories for i in [x for x in items if x.category == c][:limit]]
    for policy in policies:
        for budget in (budgets if policy != "full" else [1.0]):
            args = {"table": str(pask_table)} if policy == "pask" and pask_table else {}
            try:
                runner = accuracy.EngineRunner(accuracy.resolve_checkpoint(model), policy, budget, grammar,
                                               max_num_seqs=len(items), policy_args=args)
                summary = accuracy.report(accuracy.evaluate(runner, items, progress=False), policy, budget, split)
            except InvalidRequestError as e:  # a policy that refuses a budget is a skipped row
                print(f"{policy:<14} budget {budget:<5} skipped: {type(e).__name__}: {e}", flush=True)
                continue
            ratios = runner.kv_ratios
            summary["kv_ratio_mean"] = sum(r[0] for r in ratios) / len(ratios)
            summary["kv_ratio_max"] = max(r[1] for r in ratios)
            print(f"{policy:<14} budget {budget:<5} overall {100 * summary['overall']:.1f}%  "
                  f"ratio mean {summary['kv_ratio_mean']:.3f} max {summary['kv_ratio_max']:.3f}", flush=True)
            rows.append(summary)
    return rows


def write(rows: list[dict], out: Path, categories: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(rows, indent=1) + "\n")
    head = "| policy | budget | " + " | ".join(categories) + " | overall | ratio mean | ratio max |"
    lines = [head, "|" + "---|" * (len(categories) + 5)]
    for r in rows:
        cells = " | ".join(f"{100 * r['accuracy'][c]:.1f}" for c in categories)
        lines.append(f"| {r['policy']} | {r['budget']} | {cells} | {100 * r['overall']:.1f} | "
                     f"{r['kv_ratio_mean']:.3f} | {r['kv_ratio_max']:.3f} |")
    n = rows[0]["num_examples"] if rows else {}
    (out / "sweep.md").write_text(f"Accuracy (%) by total KV budget; examples per category: {n}\n\n"
                                  + "\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    full = [r for r in rows if r["policy"] == "full"]
    for policy in dict.fromkeys(r["policy"] for r in rows if r["policy"] != "full"):
        pts = sorted((r["budget"], 100 * r["overall"]) for r in rows if r["policy"] == policy)
        ax.plot(*zip(*pts), marker="o", label=policy)
    if full:
        ax.axhline(100 * full[0]["overall"], color="black", linestyle="--", label="full KV")
    ax.set_xlabel("total KV budget (bytes held / full KV bytes)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title("Function-calling accuracy vs KV budget")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "sweep.png", dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--budgets", nargs="+", type=float, default=list(BUDGETS))
    ap.add_argument("--split", default="test", choices=("dev", "test"))
    ap.add_argument("--category", nargs="+", default=list(accuracy.synth.CATEGORIES))
    ap.add_argument("--limit", type=int, help="examples per category")
    ap.add_argument("--model", type=Path)
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    ap.add_argument("--no-grammar", action="store_true", help="decode without the tools grammar "
                    "(PASK's structural tags then come from the lexer alone)")
    ap.add_argument("--pask-table", type=Path, help="PASK table folder (default: shipped for the model)")
    args = ap.parse_args(argv)
    bad = [b for b in args.budgets if not 0.0 < b <= 1.0]
    if bad:
        ap.error(f"budgets must be in (0, 1]: {bad}")
    unknown = [c for c in args.category if c not in accuracy.synth.CATEGORIES]
    if unknown:
        ap.error(f"unknown categories {unknown}; choose from {', '.join(accuracy.synth.CATEGORIES)}")
    rows = run(args.policies, args.budgets, args.split, args.category, args.limit, args.model,
               not args.no_grammar, args.pask_table)
    write(rows, args.out, args.category)
    print(f"wrote {args.out / 'sweep.md'}, sweep.json, sweep.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
