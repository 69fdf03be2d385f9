"""Plot the embedded model's training log: answer-token loss and dev exact match per category.

    python -m bench.learning_curve [--log ~/.cache/structkv-train/log.jsonl] [--out docs/results]

Writes ``learning_curve.png`` and ``learning_curve.md`` (the evaluation rows as a table).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from models.train import DEFAULT_CKPT_DIR


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.learning_curve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--log", type=Path, default=DEFAULT_CKPT_DIR / "log.jsonl")
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    args = ap.parse_args(argv)
    if not args.log.is_file():
        print(f"error: no training log at {args.log} (written by python -m models.train)", file=sys.stderr)
        return 2
    # A run resumed from an earlier checkpoint logs some steps twice: keep the last record of each.
    by_step_row = {}
    for line in args.log.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            by_step_row[row["step"]] = row
    rows = [by_step_row[s] for s in sorted(by_step_row)]
    evals = [r for r in rows if "dev_exact_match" in r]
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    window = 25
    steps = [r["step"] for r in rows]
    loss = [sum(r["loss"] for r in rows[max(0, i - window):i + 1]) / len(rows[max(0, i - window):i + 1])
            for i in range(len(rows))]
    a.plot(steps, loss)
    a.set_yscale("log")
    a.set_xlabel("step")
    a.set_ylabel(f"answer-token loss ({window}-step mean)")
    a.grid(alpha=0.3)
    cats = sorted({c for r in evals for c in r["dev_exact_match"]})
    for c in cats:
        pts = [(r["step"], 100 * r["dev_exact_match"][c]) for r in evals if c in r["dev_exact_match"]]
        b.plot(*zip(*pts), marker=".", label=c)
    b.set_xlabel("step")
    b.set_ylabel("dev exact match (%), unseen functions")
    b.grid(alpha=0.3)
    b.legend(fontsize=8)
    fig.tight_layout()
    args.out.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out / "learning_curve.png", dpi=110)
    lines = ["| step | tokens processed | " + " | ".join(cats) + " |", "|" + "---|" * (len(cats) + 2)]
    tokens = 0
    by_step = {}
    for r in rows:
        tokens += r["tokens"]
        by_step[r["step"]] = tokens
    for r in evals:
        cells = " | ".join(f"{100 * r['dev_exact_match'].get(c, float('nan')):.0f}" for c in cats)
        lines.append(f"| {r['step']} | {by_step[r['step']] / 1e6:.1f}M | {cells} |")
    (args.out / "learning_curve.md").write_text(
        "Dev exact match (%) during training (small dev samples per category; unseen functions)\n\n"
        + "\n".join(lines) + "\n")
    print(f"wrote {args.out / 'learning_curve.png'} and learning_curve.md ({len(rows)} steps, {len(evals)} evaluations)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
