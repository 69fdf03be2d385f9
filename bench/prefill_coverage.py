"""Which prompt tokens a prefill compressor keeps, per layer, on ``long_context`` prompts.

    python -m bench.prefill_coverage [--split test] [--start 0] [--limit 40] [--prefill-tokens 512]
                                     [--rows compilerkv snapkv compilerkv@kernel=9 oracle-request ...]
                                     [--out docs/results] [--name prefill_coverage]

A diagnostic, not a policy comparison: it explains the prefill sweep (``bench.sweep
--prefill-tokens``). Every ``long_context`` prompt of ``models.synth`` holds one request paragraph
("Request: ...", where the argument values are stated) among filler notes, after a tool list. For
each row this runs the prompts through the engine (greedy, tools grammar, B prompt tokens per
layer, generated tokens kept) and reports the accuracy beside the *request recall* of every layer:
the share of the request's tokens that layer keeps, averaged over prompts. CompilerKV rows also
give the share of layers whose kept count the risk gate set (it asked for fewer tokens than the
top-B clamp allows; elsewhere the clamp set it) and how much of the prompt the gate asked for.

Rows are ``bench.sweep`` policy names (and its variants), optionally with policy settings after
``@`` (``compilerkv@kernel=9,window=64``: numbers are parsed as int or float), plus oracle rows that read the
ground-truth request span and so cannot be served: ``oracle-request`` is CompilerKV with the
request tokens and the first 4 tokens (attention sinks) moved to the top of every layer's ranking
(the other tokens by CompilerKV's score, the same B); ``oracle-request-layers-N,M`` does it in the
listed layers only. Writes ``<name>.md`` and ``<name>.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from bench import accuracy, sweep
from models import synth
from replicas.policies import POLICIES, CompilerKVPolicy
from replicas.policies.compilerkv import gate_record

REQUEST_SPANS: dict[str, torch.Tensor] = {}   # request id -> token positions of the request paragraph
SINKS = 4


def request_span(tokenizer, item: accuracy.Item) -> torch.Tensor:
    """Token positions ``[m]`` (int64) of the "Request: ..." paragraph in the rendered prompt.

    Raises:
        ValueError: the prompt has no request paragraph (not a synthetic ``long_context`` item).
    """
    text = tokenizer.apply_chat_template(item.messages, tools=item.tools, add_generation_prompt=True, tokenize=False)
    start = text.find("Request: ")
    if start < 0:
        raise ValueError(f"{item.id}: no 'Request: ' paragraph in the prompt")
    end = text.find("\n\n", start)
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    return torch.tensor([i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < end and b > start])


@dataclass
class OracleRequestPolicy(CompilerKVPolicy):
    """CompilerKV whose ranking puts the ground-truth request span and the first tokens first
    (in ``oracle_layers``, or every layer when empty). Diagnostic only."""
    oracle_layers: tuple[int, ...] = ()
    name = "oracle-request"

    def layer_scores(self, view, layer, budget_tokens):
        positions, score, threshold = super().layer_scores(view, layer, budget_tokens)
        if self.oracle_layers and layer not in self.oracle_layers:
            return positions, score, threshold
        must = torch.cat([REQUEST_SPANS[view.seq.request_id], torch.arange(SINKS)])
        return positions, score + 10.0 * torch.isin(positions, must).float(), 1.0


def _number(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        return float(text)


ORACLE_LAYERS = re.compile(r"oracle-request-layers-(\d+(?:,\d+)*)")


def resolve_row(row: str, num_layers: int | None = None) -> tuple[str, dict]:
    """(policy name, policy arguments) of a row, checked by building its policy (no model needed).

    Raises:
        ValueError: an unknown or uncompressed row, a setting after ``@`` that is not
            ``key=number`` or that the policy refuses, ``prefill_tokens`` given as a setting, or
            an oracle layer outside ``[0, num_layers)``; the message names the row.
    """
    name, _, extra = row.partition("@")
    try:
        settings = {k: _number(v) for k, v in (kv.split("=", 1) for kv in extra.split(",") if kv)}
    except ValueError:
        raise ValueError(f"row {row!r}: settings must be key=number pairs separated by commas, "
                         f"got {extra!r}") from None
    if "prefill_tokens" in settings:
        raise ValueError(f"row {row!r}: set the prompt budget with --prefill-tokens, not per row")
    if name == "oracle-request":
        policy, args = "oracle-request", {}
    elif name.startswith("oracle-request-layers-"):
        m = ORACLE_LAYERS.fullmatch(name)
        layers = tuple(int(x) for x in m.group(1).split(",")) if m else ()
        if not m or (num_layers is not None and any(x >= num_layers for x in layers)):
            raise ValueError(f"row {row!r}: expected oracle-request-layers-N[,M...] with layers in "
                             f"0..{(num_layers or 1) - 1}")
        policy, args = "oracle-request", {"oracle_layers": layers}
    elif name in sweep.CHOICES and name != "full" and not sweep.without_prefill_tokens([name]):
        policy, args = sweep.resolve(name)
    else:
        rows = [c for c in sweep.CHOICES if c != "full" and not sweep.without_prefill_tokens([c])]
        raise ValueError(f"row {row!r}: not a prompt compressor; choose from {', '.join(rows)}, "
                         "oracle-request, oracle-request-layers-N[,M...] (settings after @)")
    args = {**args, **settings}
    try:   # the policy's own checks, before any model is loaded
        (OracleRequestPolicy if policy == "oracle-request" else POLICIES[policy])(prefill_tokens=1, **args)
    except (TypeError, ValueError) as e:
        raise ValueError(f"row {row!r}: {e}") from None
    return policy, args


def run_row(row: str, items: list[accuracy.Item], prefill_tokens: int, model_dir: Path,
            max_tokens: int = 256) -> dict:
    policy, args = resolve_row(row, None)
    runner = accuracy.EngineRunner(model_dir, policy, 1.0, True, max_tokens, max_num_seqs=len(items),
                                   policy_args={**args, "prefill_tokens": prefill_tokens})
    engine = runner.engine
    for item in items:
        if item.id not in REQUEST_SPANS:
            REQUEST_SPANS[item.id] = request_span(engine.tokenizer, item)
    num_layers = engine.kv.cfg.num_layers
    recall: dict[str, list[float]] = {}
    gate_decides: list[bool] = []
    gate_asks: list[float] = []
    on_prefill = engine.policy.on_prefill

    def recording(view):
        actions = on_prefill(view)
        span = REQUEST_SPANS[view.seq.request_id]
        dropped = [set() for _ in range(num_layers)]
        for a in actions:
            dropped[a.layer].update(a.positions)
        recall[view.seq.request_id] = [sum(int(p) not in dropped[layer] for p in span) / len(span)
                                       for layer in range(num_layers)]
        for g in gate_record(view.seq.policy_state, prefill_tokens).values():   # CompilerKV rows
            gate_decides.append(g["gated"] < g["clamp"])
            gate_asks.append(g["gated"] / max(1, len(view.seq.prompt_token_ids)))
        return actions

    engine.policy.on_prefill = recording
    texts = runner.run_all(items, desc=row)
    ok = [accuracy.score(i, t) for i, t in zip(items, texts)]
    per_layer = [sum(recall[i.id][layer] for i in items) / len(items) for layer in range(num_layers)]
    return {"row": row, "accuracy": sum(ok) / len(ok), "request_recall": per_layer,
            "gate_decides": sum(gate_decides) / len(gate_decides) if gate_decides else None,
            "gate_asks": sum(gate_asks) / len(gate_asks) if gate_asks else None,
            **runner.kv_ratio_summary()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prefill_coverage", description=__doc__.split("\n\n")[0])
    ap.add_argument("--split", default="test", choices=("dev", "test"))
    ap.add_argument("--start", type=int, default=0,
                    help="index of the first long_context prompt; past the fixed evaluation set (dev 25, "
                         "test 100 prompts) the generator makes new prompts of the same split")
    ap.add_argument("--limit", type=int, default=40, help="number of long_context prompts")
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--rows", nargs="+", help="prompt compressors of bench.sweep (e.g. compilerkv, snapkv-kernel21), "
                    "with settings after @ (compilerkv@kernel=9), or oracle-request[-layers-N,M]", default=["compilerkv", "compilerkv-kernel5", "snapkv", "snapkv-kernel21", "oracle-request",
                                                  "oracle-request-layers-4,5", "oracle-request-layers-0,1,2,3"])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    ap.add_argument("--name", default="prefill_coverage")
    args = ap.parse_args(argv)
    if min(args.limit, args.prefill_tokens, args.max_tokens) < 1 or args.start < 0:
        ap.error("--limit, --prefill-tokens and --max-tokens must be at least 1, --start at least 0")
    try:
        model_dir = accuracy.resolve_checkpoint(args.model)
    except accuracy.CheckpointNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    num_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    try:
        for r in args.rows:
            resolve_row(r, num_layers)
    except ValueError as e:
        ap.error(str(e))
    POLICIES.setdefault("oracle-request", OracleRequestPolicy)
    items = [accuracy.Item(ex.id, ex.category, ex.messages, ex.tools, ex.tools, ex.ground_truth)
             for ex in synth.Generator(args.split).examples("long_context", args.limit, start=args.start)]
    rows = []
    for row in args.rows:
        rows.append(run_row(row, items, args.prefill_tokens, model_dir, args.max_tokens))
        r = rows[-1]
        gate = "" if r["gate_decides"] is None else (f"  gate decides {100 * r['gate_decides']:.0f}% of layers, "
                                                     f"asks for {100 * r['gate_asks']:.0f}% of the prompt")
        print(f"{row:<32} {100 * r['accuracy']:5.1f}%  request recall by layer "
              + " ".join(f"{x:.2f}" for x in r["request_recall"]) + gate, flush=True)
    result = {"split": args.split, "start": args.start, "prompts": len(items), "prefill_tokens": args.prefill_tokens, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    layers = len(rows[0]["request_recall"])
    lines = [f"Request recall per layer ({args.split} split, long_context prompts {args.start}-"
             f"{args.start + len(items) - 1}, "
             f"{args.prefill_tokens} prompt tokens per layer; oracle rows read the ground-truth span)", "",
             "| row | accuracy % | " + " | ".join(f"L{i}" for i in range(layers)) + " | gate decides | gate asks |",
             "|---|---:|" + "---:|" * layers + "---:|---:|"]
    for r in rows:
        gate = (" | |" if r["gate_decides"] is None
                else f" | {100 * r['gate_decides']:.0f} % | {100 * r['gate_asks']:.0f} % |")
        lines.append(f"| {r['row']} | {100 * r['accuracy']:.1f} | "
                     + " | ".join(f"{x:.2f}" for x in r["request_recall"]) + gate)
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
