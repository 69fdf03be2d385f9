"""Function-calling accuracy (BFCL AST rules) of a model on the synthetic task or on real BFCL.

    python -m bench.accuracy --policy full --split test [--category C] [--limit N] [--json PATH]
    python -m bench.accuracy --split bfcl            # the real BFCL non-live questions
    python -m bench.accuracy --policy snapkv --prefill-tokens 512 --category long_context

Prints a per-category table and writes the same numbers as JSON (keys ``policy``, ``budget``,
``split``, ``accuracy`` (category -> fraction), ``overall`` (unweighted mean over categories, as
BFCL averages), ``num_examples``, and the achieved KV budget ratio ``kv_ratio_mean`` /
``kv_ratio_max`` over requests). Decoding is greedy, batched through our engine (``--backend hf``
runs ``transformers`` instead, full KV only); ``--grammar`` constrains output with the tools grammar.
``--prefill-tokens B`` compresses the prompt only, to ``B`` tokens per layer, keeping every
generated token (the KV-size setting of the SnapKV / PyramidKV / CompilerKV LongBench tables);
it applies to the prompt-scoring policies (PREFILL_POLICIES) at total budget 1.0.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from models import CheckpointNotFoundError, bfcl, chat, resolve_checkpoint, synth
from models.checker import check
from replicas.policies import POLICIES
SPLITS = ("dev", "test", "bfcl")
PREFILL_POLICIES = tuple(n for n, cls in POLICIES.items()
                         if "prefill_tokens" in getattr(cls, "__dataclass_fields__", {}))


@dataclass(frozen=True)
class Item:
    id: str
    category: str
    messages: list[dict[str, str]]
    tools: list[dict[str, Any]]          # OpenAI format, for the chat template
    functions: list[dict[str, Any]]      # as the checker should read them
    ground_truth: list[dict[str, Any]]


def load_items(split: str, categories: list[str]) -> list[Item]:
    items = []
    for category in categories:
        if split == "bfcl":
            for q in bfcl.load_questions(category):
                if q.ground_truth is None and category != "irrelevance":
                    continue
                tools = [bfcl.to_openai_tool(f, q.language) for f in q.functions]
                # Java / JavaScript: values are source strings, checked as strings (BFCL converts
                # them with language parsers first; ours is the plain-string approximation).
                items.append(Item(q.id, category, q.messages, tools,
                                  q.functions if q.language == "python" else tools, q.ground_truth or []))
        else:
            for ex in synth.eval_examples(split, category):
                items.append(Item(ex.id, category, ex.messages, ex.tools, ex.tools, ex.ground_truth))
    return items


class HFGreedyRunner:
    """Greedy decoding with ``transformers`` (full KV), one request at a time."""

    def __init__(self, model_dir: Path, max_new_tokens: int = 256):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.max_new_tokens = max_new_tokens

    def __call__(self, item: Item) -> str:
        ids = self.tokenizer.apply_chat_template(item.messages, tools=item.tools, add_generation_prompt=True,
                                                 return_tensors="pt", return_dict=True)["input_ids"]
        with self.torch.no_grad():
            out = self.model.generate(ids, max_new_tokens=self.max_new_tokens, do_sample=False,
                                      pad_token_id=self.model.config.pad_token_id)
        return self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


class EngineRunner:
    """Greedy decoding through our engine, all items of a run batched together."""

    def __init__(self, model_dir: Path, policy: str, budget: float, grammar: bool,
                 max_new_tokens: int = 256, max_num_seqs: int = 16, policy_args: dict | None = None,
                 enable_prefix_caching: bool = False):
        from replicas.config import EngineConfig
        from replicas.engine import LLMEngine
        self.engine = LLMEngine(EngineConfig(model=str(model_dir), kv_policy=policy, kv_budget=budget,
                                             max_num_seqs=max_num_seqs, kv_policy_args=policy_args or {},
                                             enable_prefix_caching=enable_prefix_caching))
        self.grammar, self.max_new_tokens = grammar, max_new_tokens
        self.kv_ratios: list[tuple[float, float]] = []

    def run_all(self, items: list[Item], progress: bool = True, desc: str = "eval") -> list[str]:
        from replicas.grammar import GrammarSpec
        from replicas.sampling_params import SamplingParams
        eng, params = self.engine, SamplingParams(max_tokens=self.max_new_tokens)
        texts: dict[str, str] = {}
        self.texts = texts
        for item in items:
            ids = eng.tokenizer.apply_chat_template(item.messages, tools=item.tools, add_generation_prompt=True,
                                                    return_dict=True)["input_ids"]
            spec = GrammarSpec("tools", {"tools": item.tools, "tool_choice": "auto"}) if self.grammar else None
            eng.add_request(item.id, ids, params, spec)
        with tqdm(total=len(items), desc=desc, disable=not progress, dynamic_ncols=True) as bar:
            while eng.has_unfinished():
                for out in eng.step():
                    if out.finished:
                        texts[out.request_id] = out.text
                        self.kv_ratios.append((out.metrics.kv_ratio_mean, out.metrics.kv_ratio_max))
                        bar.update(1)
        return [texts[i.id] for i in items]

    def kv_ratio_summary(self) -> dict[str, float]:
        """Achieved KV budget ratio over the requests run so far: ``kv_ratio_mean`` (of the
        per-request means) and ``kv_ratio_max``."""
        return {"kv_ratio_mean": sum(r[0] for r in self.kv_ratios) / len(self.kv_ratios),
                "kv_ratio_max": max(r[1] for r in self.kv_ratios)}


def score(item: Item, text: str) -> bool:
    try:
        calls, _ = chat.parse_tool_calls(text)
    except ValueError:
        return item.category == "irrelevance"  # unparseable output is "no call", as BFCL counts it
    return check(item.functions, calls, item.ground_truth, item.category).valid


def evaluate(runner, items: list[Item], progress: bool = True, desc: str = "eval") -> dict[str, list[bool]]:
    if hasattr(runner, "run_all"):
        texts = runner.run_all(items, progress, desc)
    else:
        texts = [runner(i) for i in tqdm(items, desc=desc, disable=not progress, dynamic_ncols=True)]
    results: dict[str, list[bool]] = {}
    for item, text in zip(items, texts):
        results.setdefault(item.category, []).append(score(item, text))
    return results


def report(results: dict[str, list[bool]], policy: str, budget: float, split: str) -> dict[str, Any]:
    accuracy = {c: sum(v) / len(v) for c, v in results.items()}
    return {"policy": policy, "budget": budget, "split": split, "accuracy": accuracy,
            "overall": sum(accuracy.values()) / len(accuracy) if accuracy else 0.0,
            "num_examples": {c: len(v) for c, v in results.items()}}


def format_table(summary: dict[str, Any]) -> str:
    rows = [f"{'category':<20} {'accuracy':>9} {'n':>5}"]
    for c, acc in summary["accuracy"].items():
        rows.append(f"{c:<20} {100 * acc:>8.1f}% {summary['num_examples'][c]:>5}")
    rows.append(f"{'overall':<20} {100 * summary['overall']:>8.1f}%")
    return "\n".join(rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.accuracy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="full", choices=list(POLICIES), help="KV policy")
    ap.add_argument("--budget", type=float, default=1.0, help="total KV budget (fraction of full KV)")
    ap.add_argument("--split", default="test", choices=SPLITS)
    ap.add_argument("--category", action="append", help="category (repeatable); default: all of the split")
    ap.add_argument("--limit", type=int, help="at most N examples per category")
    ap.add_argument("--model", type=Path, help="HF checkpoint folder (default: the embedded model)")
    ap.add_argument("--json", type=Path, help="also write the summary as JSON here")
    ap.add_argument("--backend", default="engine", choices=("engine", "hf"), help="decoder to run")
    ap.add_argument("--grammar", action="store_true", help="constrain output with the tools grammar")
    ap.add_argument("--pask-table", type=Path, help="PASK table folder (default: the one shipped for the model)")
    ap.add_argument("--prefill-tokens", type=int, help="compress the prompt only, to this many tokens per layer")
    ap.add_argument("--max-tokens", type=int, default=256, help="generated tokens per answer at most")
    ap.add_argument("--enable-prefix-caching", action="store_true",
                    help="serve with the engine's prefix cache (the summary adds its hit counts and a digest "
                         "of every answer, to compare with a run without)")
    args = ap.parse_args(argv)
    known = bfcl.CATEGORIES if args.split == "bfcl" else synth.CATEGORIES
    for c in args.category or []:
        if c not in known:
            ap.error(f"unknown category {c!r} for split {args.split!r}; choose from {', '.join(known)}")
    if args.limit is not None and args.limit < 1:
        ap.error("--limit must be at least 1")
    if args.max_tokens < 1:
        ap.error("--max-tokens must be at least 1")
    if not 0.0 < args.budget <= 1.0:
        ap.error("--budget must be in (0, 1]")
    if args.prefill_tokens is not None:
        if args.prefill_tokens < 1:
            ap.error("--prefill-tokens must be at least 1")
        if args.policy not in PREFILL_POLICIES:
            ap.error(f"--prefill-tokens applies to {', '.join(PREFILL_POLICIES)}, not {args.policy!r}")
        if args.budget < 1.0:
            ap.error("--prefill-tokens compresses the prompt only: leave --budget at 1.0")
    if args.backend == "hf" and (args.policy != "full" or args.budget < 1.0 or args.prefill_tokens is not None):
        ap.error("--backend hf runs full KV only: drop --policy / --budget / --prefill-tokens, or use --backend engine")
    args.category = args.category or list(known)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        model_dir = resolve_checkpoint(args.model)
        items = load_items(args.split, args.category)
    except (CheckpointNotFoundError, bfcl.BFCLDataError, synth.SynthError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.limit:
        items = [i for c in args.category for i in [x for x in items if x.category == c][: args.limit]]
    if args.backend == "hf":
        runner = HFGreedyRunner(model_dir, args.max_tokens)
    else:
        policy_args = {"table": str(args.pask_table)} if args.pask_table and args.policy == "pask" else {}
        if args.prefill_tokens is not None:
            policy_args["prefill_tokens"] = args.prefill_tokens
        runner = EngineRunner(model_dir, args.policy, args.budget, args.grammar, args.max_tokens,
                              policy_args=policy_args, enable_prefix_caching=args.enable_prefix_caching)
    summary = report(evaluate(runner, items), args.policy, args.budget, args.split)
    if args.prefill_tokens is not None:
        summary["prefill_tokens"] = args.prefill_tokens
    if getattr(runner, "kv_ratios", None):
        summary.update(runner.kv_ratio_summary())
    if isinstance(runner, EngineRunner):   # one digest per answer: runs compare answer by answer
        summary["answer_sha256"] = {i: hashlib.sha256(t.encode()).hexdigest()[:16] for i, t in runner.texts.items()}
        if args.enable_prefix_caching:
            s = runner.engine.stats()
            summary["prefix_cache"] = {k: s[k] for k in ("prefix_cache_queries", "prefix_cache_hits",
                                                         "prefix_cache_compressed_hits", "prefix_cache_unshared_pages")}
    print(format_table(summary))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
