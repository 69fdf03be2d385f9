"""Offline compilation of the CompilerKV tables (design section 5.2-5.3).

    python -m calibration compilerkv --model PATH --out DIR [--executor ray|local] [--budgets 256 512 1024]
    python -m calibration compilerkv --model PATH --out DIR --data FILE [--answers FILE] [--dev-fraction F] [--limit N]

Unlabeled prompts (the synthetic development split: ``long_context`` and the shorter categories;
or with ``--data`` the prompts of the dev part of the user's file, split by ``calibration.data`` and
recorded in the manifest) and their full-KV greedy continuations are the data. A *rollout* compresses one prompt's prefill KV
with chosen head weights and thresholds (``replicas.policies.compilerkv``) and replays the
continuation (``calibration.replay``); its reward is

    r = -(NLL_compressed - NLL_full) - price * kept / B

(nats per continuation token; ``kept / B`` is the share of the token budget the layer kept). The
paper's reward is the NLL term alone; with it alone the gate's best arm is always 1.0 (keeping more
never hurts NLL), so we add the memory price ``price`` (recorded in the manifest).

Estimator: epsilon-greedy contextual bandits over logged rollouts. Contexts: (budget, layer, head)
for ``W_head`` with arms ``WEIGHT_ARMS``; (budget, layer, entropy bin, perplexity bin) for
``T_gate`` with arms ``GATE_ARMS``. Each rollout perturbs one layer (cycling over layers): its heads'
weights and its threshold are drawn epsilon-greedily from the running mean rewards, every other
layer uses its current greedy arms, and the rollout's reward updates the mean of each arm it drew.
Rollouts run in rounds of ``round_size`` tasks on the executor; arms are drawn from a seeded RNG and
results are applied in task order, so a seed gives the same tables with any executor. Unvisited
contexts get weight 1.0 and threshold 1.0 (no gating).
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

WEIGHT_ARMS = (0.8, 0.9, 1.0, 1.15, 1.3, 1.5)
GATE_ARMS = (0.8, 0.85, 0.9, 0.95, 1.0)


@dataclass(frozen=True)
class CompilerKVCalibrationConfig:
    """Attributes:
        model: HF checkpoint folder.
        budgets: prefill token budgets B compiled.
        long_prompts / short_prompts: dev prompts of ``long_context`` / of each of ``multiple`` and
            ``parallel_multiple`` (the shorter categories used).
        continuation_tokens: greedy full-KV continuation length replayed per prompt.
        rounds / round_size: rollouts = rounds x round_size.
        epsilon: exploration rate; price: memory price (nats per full token budget).
        entropy_bins / ppl_bins: gate context bins (perplexity edges from the data's quantiles).
        window / kernel: the utility's observation window and pooling width.
        seed: RNG seed of arm draws and of the data split.
        data: the user's data file (None: the synthetic task; then ``long_prompts`` and
            ``short_prompts`` apply); answers, data_format, dev_fraction, limit: see
            :func:`calibration.data.load_split`.
    """
    model: str
    budgets: tuple[int, ...] = (256, 512, 1024)
    long_prompts: int = 6
    short_prompts: int = 2
    continuation_tokens: int = 32
    rounds: int = 12
    round_size: int = 8
    epsilon: float = 0.3
    price: float = 0.02
    entropy_bins: int = 20
    ppl_bins: int = 4
    window: int = 32
    kernel: int = 21
    seed: int = 0
    data: str | None = None
    answers: str | None = None
    data_format: str = "auto"
    dev_fraction: float = 0.5
    limit: int | None = None


def _prompts(cfg_long: int, cfg_short: int):
    from models import synth
    out = list(synth.eval_examples("dev", "long_context")[:cfg_long])
    for cat in ("multiple", "parallel_multiple"):
        out += synth.eval_examples("dev", cat)[:cfg_short]
    return out


class CompilerKVWorker:
    """Runs rollouts for one model (one per process or Ray actor), on the synthetic dev prompts or
    on ``examples`` (anything with ``messages`` and ``tools``: ``calibration.data.CalItem``) when given."""

    def __init__(self, model: str, long_prompts: int, short_prompts: int, continuation_tokens: int,
                 window: int, kernel: int, examples: list | None = None):
        from replicas.config import EngineConfig
        from replicas.engine import LLMEngine
        self.engine = LLMEngine(EngineConfig(model=model, max_num_seqs=8))
        self.examples = list(examples) if examples is not None else _prompts(long_prompts, short_prompts)
        self.m, self.window, self.kernel = continuation_tokens, window, kernel
        self._data = None

    def run(self, task: dict) -> dict:
        if task["kind"] == "stats":
            return {"entropy": [d["entropy"] for d in self.data()], "ppl": [d["ppl"] for d in self.data()],
                    "prompt_len": [d["n"] for d in self.data()], "nll_full": [d["nll_full"] for d in self.data()]}
        if task["kind"] == "rollout":
            return self.rollout(task)
        raise ValueError(f"unknown task kind {task['kind']!r}")

    def data(self) -> list[dict]:
        """Per prompt: ids, prompt length, per-layer utilities and entropies, window perplexity,
        full-KV continuation NLL (computed once per worker)."""
        if self._data is None:
            from calibration.replay import compressed_forward, continuation_nll
            from replicas.policies.compilerkv import token_utility
            from replicas.sampling_params import SamplingParams
            eng = self.engine
            prompts = [eng.tokenizer.apply_chat_template(ex.messages, tools=ex.tools, add_generation_prompt=True,
                                                         return_dict=True)["input_ids"] for ex in self.examples]
            outs = eng.generate(prompts, SamplingParams(max_tokens=self.m, ignore_eos=True))
            data = []
            for ids, out in zip(prompts, outs):
                n, seq = len(ids), torch.tensor(ids + out.token_ids)
                states = self._prefill_states(seq[:n])
                utils, ents = [], []
                for q, k, v in states:
                    u, e = token_utility(q, torch.arange(n - q.shape[0], n), k, v, torch.arange(n), self.kernel)
                    utils.append(u)
                    ents.append(e)
                logits, _ = compressed_forward(eng.model, seq, n)
                w = min(self.window, n - 1)
                ppl = float(torch.exp(torch.nn.functional.cross_entropy(logits[n - w - 1:n - 1], seq[n - w:n])))
                data.append({"seq": seq, "n": n, "utils": utils, "entropy": ents, "ppl": ppl,
                             "nll_full": continuation_nll(logits, seq, n)})
            self._data = data
        return self._data

    @torch.inference_mode()
    def _prefill_states(self, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        from replicas.models.llama import causal_attention
        model, n, out = self.engine.model, ids.shape[0], []

        def attention(layer, q, k, v):
            out.append((q[-self.window:].float(), k.float(), v.float()))
            return causal_attention(q, k, v)
        model(ids, torch.arange(n), attention)
        return out

    def rollout(self, task: dict) -> dict:
        """Reward parts of one rollout: ``weights [L][Hq]``, ``thresholds [L]`` at ``budget`` on
        prompt ``prompt``."""
        from calibration.replay import compressed_forward, continuation_nll
        from replicas.kv_cache import Precision
        from replicas.policies.compilerkv import combine_heads, select_tokens
        d = self.data()[task["prompt"]]
        n, seq = d["n"], d["seq"]
        b = min(task["budget"], n)
        prec = torch.full((len(d["utils"]), seq.shape[0]), int(Precision.HIGH), dtype=torch.long)
        kept = []
        for layer, util in enumerate(d["utils"]):
            score = combine_heads(util, torch.tensor(task["weights"][layer]))
            protected = torch.arange(n) >= n - min(self.window, b)
            keep = select_tokens(score, protected, task["thresholds"][layer], b)
            prec[layer, :n][~keep] = int(Precision.RELEASED)
            kept.append(int(keep.sum()) / max(b, 1))
        logits, _ = compressed_forward(self.engine.model, seq, n, prec)
        return {"nll": continuation_nll(logits, seq, n), "nll_full": d["nll_full"], "kept": kept}


class Bandit:
    """Running mean reward per (context, arm) with epsilon-greedy draws."""

    def __init__(self, arms: tuple[float, ...], epsilon: float):
        self.arms, self.epsilon = arms, epsilon
        self.sum: dict[tuple, list[float]] = {}
        self.count: dict[tuple, list[int]] = {}

    def greedy(self, ctx: tuple) -> int:
        if ctx not in self.count:
            return self.arms.index(1.0)
        means = [s / c if c else float("-inf") for s, c in zip(self.sum[ctx], self.count[ctx])]
        return max(range(len(self.arms)), key=lambda i: (means[i], -abs(self.arms[i] - 1.0)))

    def draw(self, ctx: tuple, rng: random.Random) -> int:
        return rng.randrange(len(self.arms)) if rng.random() < self.epsilon else self.greedy(ctx)

    def update(self, ctx: tuple, arm: int, reward: float) -> None:
        s = self.sum.setdefault(ctx, [0.0] * len(self.arms))
        c = self.count.setdefault(ctx, [0] * len(self.arms))
        s[arm] += reward
        c[arm] += 1


def compile_tables(cfg: CompilerKVCalibrationConfig, out: Path, executor, progress: bool = True, log=None,
                   data=None):
    """Run the bandits; return the ``compilerkv`` TableArtifact (see the module docstring).
    ``data``: the ``calibration.data.DataSplit`` the executor's workers run on (None: the synthetic
    prompts), recorded in the run's settings and the manifest."""
    from calibration.artifacts import TableArtifact, build_command, model_fingerprint
    from calibration.executors import open_run, run_probes
    from models import resolve_checkpoint
    from replicas.models.llama import ModelConfig
    log = log or (lambda m: print(m, file=sys.stderr))
    model_dir = resolve_checkpoint(cfg.model)
    out = Path(out)
    settings = {**asdict(cfg), "model": str(model_dir)}
    if data is not None:
        settings["data_sha256"], settings["dev_ids"] = data.source["sha256"], data.source["dev_ids"]
    cache = open_run(out, settings)
    mc = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    L, H = mc.num_layers, mc.num_heads
    t0 = time.monotonic()
    stats = run_probes(executor, cache, [{"kind": "stats"}], "prompts", progress)[0]
    num_prompts = len(stats["ppl"])
    ent_edges = torch.linspace(0, 1, cfg.entropy_bins + 1)[1:-1]
    ppl_edges = torch.quantile(torch.tensor(stats["ppl"]), torch.linspace(0, 1, cfg.ppl_bins + 1)[1:-1])
    pbin = [int(torch.bucketize(torch.tensor(p), ppl_edges)) for p in stats["ppl"]]
    ebin = [[int(torch.bucketize(torch.tensor(e), ent_edges)) for e in row] for row in stats["entropy"]]
    log(f"{num_prompts} prompts of {min(stats['prompt_len'])}-{max(stats['prompt_len'])} tokens; "
        f"window perplexity {min(stats['ppl']):.1f}-{max(stats['ppl']):.1f}")
    wb, gb = Bandit(WEIGHT_ARMS, cfg.epsilon), Bandit(GATE_ARMS, cfg.epsilon)
    rng = random.Random(cfg.seed)
    r = 0
    for rnd in range(cfg.rounds):
        tasks, draws = [], []
        for _ in range(cfg.round_size):
            layer = r % L
            budget = cfg.budgets[(r // L) % len(cfg.budgets)]
            p = (r // (L * len(cfg.budgets))) % num_prompts
            weights, thresholds = [], []
            for l in range(L):
                arms = [wb.draw((budget, l, h), rng) if l == layer else wb.greedy((budget, l, h)) for h in range(H)]
                weights.append([WEIGHT_ARMS[a] for a in arms])
                gctx = (budget, l, ebin[p][l], pbin[p])
                g = gb.draw(gctx, rng) if l == layer else gb.greedy(gctx)
                thresholds.append(GATE_ARMS[g])
                if l == layer:
                    draws.append((budget, l, p, arms, g))
            tasks.append({"kind": "rollout", "prompt": p, "budget": budget, "weights": weights,
                          "thresholds": thresholds})
            r += 1
        for (budget, l, p, arms, g), res in zip(draws, run_probes(executor, cache, tasks, f"round {rnd + 1}/{cfg.rounds}",
                                                                   progress)):
            reward = -(res["nll"] - res["nll_full"]) - cfg.price * res["kept"][l]
            for h, a in enumerate(arms):
                wb.update((budget, l, h), a, reward)
            gb.update((budget, l, ebin[p][l], pbin[p]), g, reward)
    W = torch.tensor([[[WEIGHT_ARMS[wb.greedy((b, l, h))] for h in range(H)] for l in range(L)] for b in cfg.budgets])
    T = torch.tensor([[[[GATE_ARMS[gb.greedy((b, l, e, q))] for q in range(cfg.ppl_bins)]
                        for e in range(cfg.entropy_bins)] for l in range(L)] for b in cfg.budgets])
    visits = torch.tensor([[[[float(sum(gb.count.get((b, l, e, q), [0]))) for q in range(cfg.ppl_bins)]
                             for e in range(cfg.entropy_bins)] for l in range(L)] for b in cfg.budgets])
    tables = {"budgets": torch.tensor(cfg.budgets), "head_weights": W.float(), "gate": T.float(),
              "gate_visits": visits, "entropy_edges": ent_edges.float(), "ppl_edges": ppl_edges.float()}
    meta = {"estimator": {"name": "epsilon-greedy contextual bandit over logged rollouts", "epsilon": cfg.epsilon,
                          "weight_arms": list(WEIGHT_ARMS), "gate_arms": list(GATE_ARMS),
                          "reward": "-(NLL_compressed - NLL_full) - price * kept / B", "price": cfg.price,
                          "rollouts": cfg.rounds * cfg.round_size},
            "data": ({"split": "dev", "long_context": cfg.long_prompts, "short_per_category": cfg.short_prompts,
                      "continuation_tokens": cfg.continuation_tokens} if data is None
                     else {**data.source, "continuation_tokens": cfg.continuation_tokens}),
            "settings": {k: v for k, v in asdict(cfg).items() if k != "model"},
            "visited_weight_contexts": len(wb.count), "visited_gate_contexts": len(gb.count),
            "build_command": build_command("compilerkv", cfg, model_dir, out, CLI_SETTINGS),
            "wall_s": round(time.monotonic() - t0, 1)}
    return TableArtifact("compilerkv", tables, model_fingerprint(model_dir), meta)


CLI_SETTINGS = ("budgets", "long_prompts", "short_prompts", "rounds", "round_size", "kernel", "seed", "data",
                "answers", "data_format", "dev_fraction", "limit")


def main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m calibration compilerkv", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--executor", choices=("ray", "local"), default="ray")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--address")
    ap.add_argument("--budgets", nargs="+", type=int, default=[256, 512, 1024])
    ap.add_argument("--long-prompts", type=int, default=6)
    ap.add_argument("--short-prompts", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--round-size", type=int, default=8)
    ap.add_argument("--kernel", type=int, default=CompilerKVCalibrationConfig.kernel,
                    help="pooling width of the token utility (odd); the policy uses the tables' width")
    ap.add_argument("--seed", type=int, default=0, help="seed of the arm draws and of the data split")
    ap.add_argument("--data", help="use the prompts of this file (BFCL questions or OpenAI-style JSONL, see "
                    "calibration/data.py) instead of the synthetic task; --long-prompts / --short-prompts then do not apply")
    ap.add_argument("--answers", help="BFCL possible-answer file (default: possible_answer/<name> beside --data)")
    ap.add_argument("--data-format", choices=("auto", "bfcl", "openai"), default="auto")
    ap.add_argument("--gpus-per-worker", type=float, default=0, help="GPUs each Ray worker reserves (0: the "
                    "workers' engines run on CPU; 1 for a real checkpoint on a GPU cluster)")
    ap.add_argument("--dev-fraction", type=float, default=0.5, help="share of the examples calibrated on; the rest is held out")
    ap.add_argument("--limit", type=int, help="read only the first N examples of --data")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    from models import CheckpointNotFoundError, resolve_checkpoint
    if any(b < 1 for b in args.budgets):
        ap.error("budgets must be positive token counts")
    if args.kernel < 1 or args.kernel % 2 == 0:
        ap.error(f"--kernel must be a positive odd width, got {args.kernel}")
    from models import synth
    available = synth.EVAL_SIZES["dev"]
    if not 1 <= args.long_prompts <= available["long_context"]:
        ap.error(f"--long-prompts must be in 1..{available['long_context']} (the dev long_context set)")
    if not 0 <= args.short_prompts <= available["default"]:
        ap.error(f"--short-prompts must be in 0..{available['default']} (per shorter dev category)")
    if args.rounds < 1 or args.round_size < 1:
        ap.error("--rounds and --round-size must be at least 1")
    try:
        model_dir = resolve_checkpoint(args.model)
    except CheckpointNotFoundError as e:
        ap.error(str(e))
    from calibration.data import cli_split
    data = cli_split(ap, args)   # before anything is written: bad data leaves no run folder
    if data is False:
        return 2
    cfg = CompilerKVCalibrationConfig(str(model_dir), tuple(sorted(args.budgets)), args.long_prompts,
                                      args.short_prompts, rounds=args.rounds, round_size=args.round_size,
                                      kernel=args.kernel, seed=args.seed,
                                      **({"data": data.source["path"], "answers": data.source["answers"],
                                          "data_format": args.data_format, "dev_fraction": args.dev_fraction,
                                          "limit": args.limit} if data else {}))
    wargs = (str(model_dir), cfg.long_prompts, cfg.short_prompts, cfg.continuation_tokens, cfg.window, cfg.kernel,
             data.dev if data else None)
    from calibration.executors import make_executor
    executor = make_executor(args.executor, CompilerKVWorker, wargs, args.workers, args.address,
                             args.gpus_per_worker)
    try:
        artifact = compile_tables(cfg, args.out, executor, progress=not args.no_progress, data=data)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        executor.close()
    artifact.save(args.out)
    print(f"wrote {args.out}")
    return 0
