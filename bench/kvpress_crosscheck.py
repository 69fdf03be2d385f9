"""Cross-check of our SnapKV, PyramidKV and StreamingLLM against NVIDIA kvpress on the same prompts.

    python -m bench.kvpress_crosscheck --kvpress-python /root/.cache/kvpress-venv/bin/python \\
        [--category long_context] [--limit 20] [--prefill-tokens 512 1024] [--out docs/results]

Both sides compress the prompt only, to ``B`` tokens, and keep every generated token (kvpress
compresses at prefill: ``compression_ratio`` is set per prompt so that it keeps exactly ``B``),
then decode greedily without a grammar (kvpress runs ``transformers``' ``generate``). Reported
side by side per (method, B): accuracy under the BFCL AST checker, and the share of answers whose
text is identical. Full KV (ours against ``transformers``) is the control for the agreement.

Known differences, by design: kvpress selects tokens per KV head, our cache keeps or releases a
token for all heads of a layer (scores summed over heads); SnapKV's scores are otherwise the
same recipe (window 64, kernel 5, average pooling; window always kept), StreamingLLM's too (4 sinks,
true positions kept, no re-rotation). PyramidKV: both draw an arithmetic sequence of per-layer
budgets with ratio ``beta`` = 20 over SnapKV's scores, but kvpress (0.5.5) draws it over the kept
tokens window included and falls back to a uniform (SnapKV) split when its last layer's share is
under the window (``B < beta * window`` = 1,280 tokens, unless its clamp of the first layer to
``n - window`` lifts the last), while ours follows the paper's code (pyramid above the window, no fallback).
Before the texts, the tool prints and stores each side's per-layer kept tokens for the first
prompt at every ``B`` (``allocations``), which is deterministic.

kvpress pins its own ``transformers``, so it lives in a separate virtual environment
(``python -m venv V && V/bin/pip install kvpress torch==2.13.0``); this module re-runs itself
there with ``--worker`` for the kvpress side. It is never a dependency of the product.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
METHODS = ("full", "snapkv", "pyramidkv", "streaming_llm")


def _items(category: str, limit: int, split: str):
    from models import synth
    return synth.eval_examples(split, category)[:limit]


def worker(model_dir: str, category: str, limit: int, split: str, budgets: list[int], max_tokens: int) -> dict:
    """The kvpress side (runs in kvpress's environment): texts per method and budget."""
    import torch
    from types import SimpleNamespace
    from kvpress import PyramidKVPress, SnapKVPress, StreamingLLMPress
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    from importlib.metadata import version
    out: dict = {"kvpress": version("kvpress"), "texts": {}, "allocations": {}}
    num_layers = model.config.num_hidden_layers
    for ex in _items(category, limit, split):
        ids = tok.apply_chat_template(ex.messages, tools=ex.tools, add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        n = ids.shape[1]
        runs = [("full", None, None)]
        for b in budgets:
            ratio = max(0.0, (n - b - 0.5) / n)   # kvpress keeps int(n * (1 - ratio)) = b tokens
            # PyramidKVPress rounds its per-layer budgets (round, not int): the exact ratio gives b.
            pyramid = PyramidKVPress(compression_ratio=max(0.0, (n - b) / n), window_size=64, kernel_size=5, beta=20)
            runs += [("snapkv", b, SnapKVPress(compression_ratio=ratio, window_size=64, kernel_size=5)),
                     ("pyramidkv", b, pyramid),
                     ("streaming_llm", b, StreamingLLMPress(compression_ratio=ratio, n_sink=4))]
            if not out["allocations"].get(str(b)) and pyramid.compression_ratio > 0:
                out["allocations"][str(b)] = {"prompt_tokens": n, "layers": [
                    pyramid.get_layer_budget(SimpleNamespace(config=model.config, layer_idx=i), n)
                    for i in range(num_layers)]}
        for method, b, press in runs:
            with torch.no_grad():
                if press is None or press.compression_ratio == 0.0:
                    gen = model.generate(ids, max_new_tokens=max_tokens, do_sample=False,
                                         pad_token_id=model.config.pad_token_id)
                else:
                    with press(model):
                        gen = model.generate(ids, max_new_tokens=max_tokens, do_sample=False,
                                             pad_token_id=model.config.pad_token_id)
            text = tok.decode(gen[0, n:], skip_special_tokens=True)
            out["texts"][f"{method}/{b}/{ex.id}"] = text
    return out


def our_allocation(num_layers: int, prompt_tokens: int, b: int) -> list[int]:
    """Prompt tokens each layer of our PyramidKV keeps after prefill with ``prefill_tokens=b``."""
    from replicas.policies import PyramidKVPolicy
    from replicas.sampling_params import SamplingParams
    from replicas.sequence import Sequence
    seq = Sequence("allocation", [0] * prompt_tokens, SamplingParams())
    return PyramidKVPolicy(prefill_tokens=b).layer_quotas(seq, num_layers, 1.0, prompt_tokens)


def ours(model_dir: Path, category: str, limit: int, split: str, budgets: list[int], max_tokens: int) -> dict:
    from bench import accuracy
    items = [i for i in accuracy.load_items(split, [category])][:limit]
    texts = {}
    for method in METHODS:
        for b in ([None] if method == "full" else budgets):
            args = {} if b is None else {"prefill_tokens": b}
            runner = accuracy.EngineRunner(model_dir, method, 1.0, False, max_tokens, max_num_seqs=16,
                                           policy_args=args)
            for item, text in zip(items, runner.run_all(items, progress=False)):
                texts[f"{method}/{b}/{item.id}"] = text
    return {"texts": texts, "items": items}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.kvpress_crosscheck", description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvpress-python", help="python of a virtual environment with kvpress installed")
    ap.add_argument("--category", default="long_context")
    ap.add_argument("--split", default="test", choices=("dev", "test"))
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--prefill-tokens", nargs="+", type=int, default=[512, 1024])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(str(args.model), args.category, args.limit, args.split, args.prefill_tokens,
                                args.max_tokens)))
        return 0
    from bench import accuracy
    from models import synth
    if args.category not in synth.CATEGORIES:
        ap.error(f"unknown category {args.category!r}; choose from {', '.join(synth.CATEGORIES)}")
    if args.limit < 1 or min(args.prefill_tokens) < 1 or args.max_tokens < 1:
        ap.error("--limit, --prefill-tokens and --max-tokens must be at least 1")
    if not args.kvpress_python:
        ap.error("--kvpress-python is required (a virtual environment with kvpress; see the module docstring)")
    model_dir = accuracy.resolve_checkpoint(args.model)
    cmd = [args.kvpress_python, "-m", "bench.kvpress_crosscheck", "--worker", "--model", str(model_dir),
           "--category", args.category, "--split", args.split, "--limit", str(args.limit),
           "--max-tokens", str(args.max_tokens), "--prefill-tokens", *map(str, args.prefill_tokens)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    except OSError as e:
        print(f"error: cannot run --kvpress-python {args.kvpress_python!r}: {e}", file=sys.stderr)
        return 1
    if proc.returncode != 0:
        print(f"error: the kvpress worker failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
        return 1
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    mine = ours(model_dir, args.category, args.limit, args.split, args.prefill_tokens, args.max_tokens)
    items = mine["items"]
    rows = []
    for method in METHODS:
        for b in ([None] if method == "full" else args.prefill_tokens):
            keys = [f"{method}/{b}/{i.id}" for i in items]
            ok_ours = [accuracy.score(i, mine["texts"][k]) for i, k in zip(items, keys)]
            ok_theirs = [accuracy.score(i, theirs["texts"][k]) for i, k in zip(items, keys)]
            same = [mine["texts"][k] == theirs["texts"][k] for k in keys]
            rows.append({"method": method, "prefill_tokens": b, "n": len(items),
                         "accuracy_ours": sum(ok_ours) / len(items), "accuracy_kvpress": sum(ok_theirs) / len(items),
                         "verdict_agreement": sum(a == b_ for a, b_ in zip(ok_ours, ok_theirs)) / len(items),
                         "same_text": sum(same) / len(items)})
    from transformers import AutoConfig
    num_layers = AutoConfig.from_pretrained(model_dir).num_hidden_layers
    allocations = {}
    for b, theirs_alloc in theirs["allocations"].items():
        allocations[b] = {"prompt_tokens": theirs_alloc["prompt_tokens"], "kvpress": theirs_alloc["layers"],
                          "ours": our_allocation(num_layers, theirs_alloc["prompt_tokens"], int(b))}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kvpress_crosscheck.json").write_text(json.dumps(
        {"model": str(model_dir), "category": args.category, "split": args.split, "kvpress": theirs["kvpress"],
         "rows": rows, "pyramidkv_allocations": allocations, "texts": {"ours": mine["texts"], "kvpress": theirs["texts"]}}, indent=1) + "\n")
    lines = [f"Ours vs NVIDIA kvpress {theirs['kvpress']} on `{args.category}` ({args.split} split, first "
             f"{len(items)}; greedy, no grammar, prompt compressed to B tokens, generated tokens kept).", "",
             "| method | B | accuracy ours | accuracy kvpress | same verdict | identical text |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['prefill_tokens'] or 'all'} | {100 * r['accuracy_ours']:.1f} | "
                     f"{100 * r['accuracy_kvpress']:.1f} | {100 * r['verdict_agreement']:.0f} % | "
                     f"{100 * r['same_text']:.0f} % |")
    lines += ["", "PyramidKV: prompt tokens kept per layer (layer 0 first) on the first prompt.", "",
              "| B | prompt tokens | ours | kvpress |", "|---:|---:|---|---|"]
    for b, a in allocations.items():
        lines.append(f"| {b} | {a['prompt_tokens']} | {a['ours']} | {a['kvpress']} |")
    (args.out / "kvpress_crosscheck.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
