"""Offline calibration of the PASK table (design section 4.4).

    python -m calibration pask --model PATH --out DIR [--executor ray|local] [--workers N]
    python -m calibration pask --model PATH --out DIR --data FILE [--answers FILE] [--dev-fraction F] [--limit N]

On the development split of the synthetic BFCL-style task, or on the dev part of the user's data
(``--data``: a BFCL question file or an OpenAI-style JSONL, split by ``calibration.data``; the split
is recorded in the manifest), with complete, grammar-constrained, greedy generation through our
engine, scored with the BFCL AST checker:

1. **Full KV**: accuracy ``A_full``, and each bucket's share of the generated tokens (decode side)
   and of the prompt tokens (prompt side, input-derived labels).
2. **Task-error sensitivity -> floors.** For each observed cell (bucket, layer group) of each side,
   the cell alone is set to RELEASE, then INT4, then INT8 (everything else HIGH) until accuracy stays
   within ``floor_tolerance`` of ``A_full``; that level is the cell's floor (HIGH when none passes,
   and for cells never observed).
3. **Attention-output distortion -> residual ranking.** Teacher-forced replay of the full-KV
   generations (``calibration.replay``) with one cell demoted: the relative squared change of all
   layers' attention outputs at the decode positions.
4. **Candidate family.** From the floors, adjacent upgrades (one cell, one level) in order of
   distortion removed per byte added (greedy, recomputed after each upgrade).
5. **Selection.** The cheapest candidate whose accuracy is within ``alpha`` of ``A_full``
   (``alpha_decode`` = 5 %, ``alpha_prompt`` = 2 %, relative), found by bisection over the family
   (the other side at HIGH).
6. **Ablations** (decode side): the same gate without floors (the family starts from all-RELEASE)
   and without distortion ranking (upgrades in a seeded random order).

Every probe (one complete generation of the dev set, or one replay) is a task for the executor;
finished probes are kept in ``DIR/probes.jsonl``, so rerunning the same command resumes.
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from replicas.kv_cache import Precision
from replicas.policies.pask import PASKTable, SideTable, expected_fraction
from replicas.prompt_labels import NUM_PROMPT_BUCKETS, PROMPT_BUCKETS
from replicas.tagger import BUCKETS, NUM_BUCKETS

LEVELS = (Precision.RELEASED, Precision.INT4, Precision.INT8, Precision.HIGH)
SIDES = {"decode": NUM_BUCKETS, "prompt": NUM_PROMPT_BUCKETS}
DEFAULT_CATEGORIES = ("simple", "multiple", "parallel", "parallel_multiple", "irrelevance")
CLI_SETTINGS = ("num_groups", "per_category", "categories", "floor_tolerance", "alpha_decode", "alpha_prompt",
                "distortion_examples", "max_new_tokens", "seed", "data", "answers", "data_format", "dev_fraction",
                "limit")


@dataclass(frozen=True)
class PASKCalibrationConfig:
    """Settings of one calibration run (all recorded in the artifact).

    Attributes:
        model: HF checkpoint folder.
        num_groups: layer groups G (1 .. num_layers).
        per_category: development examples per category.
        categories: synthetic task categories used.
        floor_tolerance: accuracy drop (absolute) a single-cell probe may cause and still pass.
        alpha_decode / alpha_prompt: relative accuracy loss allowed to the selected candidate.
        distortion_examples: examples replayed per distortion probe.
        max_new_tokens: generation cap per example.
        seed: seed of the no-ranking ablation's order (generation is greedy) and of the data split.
        data: the user's data file (None: the synthetic task; then ``per_category`` and
            ``categories`` apply); answers, data_format, dev_fraction, limit: see
            :func:`calibration.data.load_split`.
    """
    model: str
    num_groups: int = 3
    per_category: int = 8
    categories: tuple[str, ...] = DEFAULT_CATEGORIES
    floor_tolerance: float = 0.02
    alpha_decode: float = 0.05
    alpha_prompt: float = 0.02
    distortion_examples: int = 16
    max_new_tokens: int = 128
    seed: int = 0
    data: str | None = None
    answers: str | None = None
    data_format: str = "auto"
    dev_fraction: float = 0.5
    limit: int | None = None


def layer_groups(num_layers: int, num_groups: int) -> list[tuple[int, int]]:
    """``num_groups`` contiguous, near-equal layer ranges (earlier groups get the extra layers).

    Raises:
        ValueError: ``num_groups`` outside ``[1, num_layers]``.
    """
    if not 1 <= num_groups <= num_layers:
        raise ValueError(f"num_groups must be in [1, {num_layers}], got {num_groups}")
    base, extra = divmod(num_layers, num_groups)
    out, start = [], 0
    for g in range(num_groups):
        end = start + base + (g < extra)
        out.append((start, end))
        start = end
    return out


# ---------------------------------------------------------------------------- the worker
class ProbeWorker:
    """Runs probes for one model on the dev items (one per process or Ray actor): the synthetic
    task's (``categories``, ``per_category``), or ``items`` (``calibration.data.CalItem``) when given."""

    def __init__(self, model: str, categories: list[str], per_category: int, num_groups: int,
                 max_new_tokens: int, items: list | None = None):
        from bench.accuracy import load_items
        from calibration.data import CalItem
        from replicas.config import EngineConfig
        from replicas.engine import LLMEngine
        if items is None:
            synth_items = load_items("dev", list(categories))
            items = [CalItem.from_bench(i) for c in categories
                     for i in [x for x in synth_items if x.category == c][:per_category]]
        self.items = list(items)
        self.engine = LLMEngine(EngineConfig(model=model, max_num_seqs=max(1, len(self.items))))
        self.groups = layer_groups(self.engine.model.config.num_layers, num_groups)
        self.max_new_tokens = max_new_tokens
        self._replay = None

    def run(self, task: dict) -> dict:
        if task["kind"] == "generate":
            return self.generate(task)
        if task["kind"] == "distortion":
            return self.distortion(task)
        raise ValueError(f"unknown probe kind {task['kind']!r}")

    def _prompt_ids(self, item) -> list[int]:
        return self.engine.tokenizer.apply_chat_template(item.messages, tools=item.tools, add_generation_prompt=True,
                                                         return_dict=True)["input_ids"]

    def generate(self, task: dict) -> dict:
        """Complete generation of every dev item under a fixed action table (``decode``, ``prompt``:
        nested lists ``[buckets][G]`` of Precision values)."""
        from replicas.policies.pask import PASKPolicy
        from replicas.sampling_params import SamplingParams
        eng = self.engine
        empty = torch.empty(0, 2, dtype=torch.long)
        table = PASKTable(SideTable(torch.tensor(task["decode"]), empty, torch.zeros(1)),
                          SideTable(torch.tensor(task["prompt"]), empty, torch.zeros(1)), self.groups)
        eng.policy = PASKPolicy(table)
        params = SamplingParams(max_tokens=self.max_new_tokens)
        for item in self.items:
            eng.add_request(item.id, self._prompt_ids(item), params, item.grammar())
        outs = {}
        while eng.has_unfinished():
            for out in eng.step():
                if out.finished:
                    outs[out.request_id] = out
        result = {"correct": [i.score(outs[i.id].text) for i in self.items],
                  "kv_ratio": sum(outs[i.id].metrics.kv_ratio_mean for i in self.items) / len(self.items)}
        if task.get("with_outputs"):
            result["outputs"] = [outs[i.id].token_ids for i in self.items]
            dec, pro = torch.zeros(NUM_BUCKETS, dtype=torch.long), torch.zeros(NUM_PROMPT_BUCKETS, dtype=torch.long)
            for item, out_ids in zip(self.items, result["outputs"]):
                labels, tags = self._buckets(item, out_ids)
                pro += torch.bincount(torch.tensor(labels), minlength=NUM_PROMPT_BUCKETS)
                dec += torch.bincount(torch.tensor(tags, dtype=torch.long), minlength=NUM_BUCKETS)
            result["decode_counts"], result["prompt_counts"] = dec.tolist(), pro.tolist()
        return result

    def _buckets(self, item, out_ids: list[int]) -> tuple[list[int], list[int]]:
        """Prompt labels of the item's prompt and structural buckets of its generated tokens, as
        the engine computes them."""
        from replicas.engine import _tagger_for
        from replicas.prompt_labels import prompt_labels
        from replicas.tagger import bucket_of
        tok = self.engine.tokenizer
        tagger = _tagger_for(item.grammar())
        return (prompt_labels(tok, self._prompt_ids(item)),
                [bucket_of(tagger.feed(tok.decode([t]))) for t in out_ids])

    def _replay_data(self):
        """Full-KV generations of the first ``distortion_examples`` items, their buckets and base
        attention outputs (computed once per worker)."""
        if self._replay is None:
            from calibration.replay import compressed_forward
            full = [[int(Precision.HIGH)] * len(self.groups)]
            res = self.generate({"kind": "generate", "decode": full * NUM_BUCKETS, "prompt": full * NUM_PROMPT_BUCKETS,
                                 "with_outputs": True})
            data = []
            for item, out_ids in zip(self.items, res["outputs"]):
                ids = self._prompt_ids(item)
                labels, dec = self._buckets(item, out_ids)
                seq = torch.tensor(ids + out_ids)
                _, base = compressed_forward(self.engine.model, seq, len(ids), None, capture=True)
                data.append((seq, len(ids), torch.tensor(labels), torch.tensor(dec, dtype=torch.long), base))
            self._replay = data
        return self._replay

    def distortion(self, task: dict) -> dict:
        """Mean relative squared change of the attention outputs at the decode positions when the
        cell (``side``, ``bucket``, ``group``) is set to ``level`` (over the examples holding it)."""
        from calibration.replay import compressed_forward
        start, end = self.groups[task["group"]]
        values = []
        for seq, prompt_len, labels, dec, base in self._replay_data()[: task["examples"]]:
            n = seq.shape[0]
            if n == prompt_len:
                continue
            mask = torch.zeros(n, dtype=torch.bool)
            if task["side"] == "prompt":
                mask[:prompt_len] = labels == task["bucket"]
            else:
                mask[prompt_len:] = dec == task["bucket"]
            if not mask.any():
                continue
            prec = torch.full((self.engine.model.config.num_layers, n), int(Precision.HIGH), dtype=torch.long)
            prec[start:end, mask] = task["level"]
            _, outs = compressed_forward(self.engine.model, seq, prompt_len, prec, capture=True)
            num = sum(float((o - b).pow(2).sum()) for o, b in zip(outs, base))
            den = sum(float(b.pow(2).sum()) for b in base)
            values.append(num / max(den, 1e-12))
        return {"distortion": sum(values) / len(values) if values else 0.0, "examples": len(values)}


# ---------------------------------------------------------------------------- pure steps
def floors_from_probes(observed: torch.Tensor, passed: dict[tuple[int, int, int], bool]) -> torch.Tensor:
    """Floors ``[B, G]``: per observed cell the cheapest level whose probe passed, trying levels in
    increasing order (a level is only probed when all cheaper ones failed); HIGH otherwise."""
    b, g = observed.shape
    floors = torch.full((b, g), int(Precision.HIGH), dtype=torch.long)
    for bucket in range(b):
        for group in range(g):
            if not observed[bucket, group]:
                continue
            for level in LEVELS[:-1]:
                if passed.get((bucket, group, int(level))):
                    floors[bucket, group] = int(level)
                    break
    return floors


def build_family(floors: torch.Tensor, distortion: torch.Tensor, weights: torch.Tensor,
                 costs: torch.Tensor, order: str = "distortion", seed: int = 0) -> list[tuple[int, int]]:
    """The nested family's upgrades, from ``floors`` to all-HIGH on observed cells.

    Args:
        floors: ``[B, G]`` starting levels.
        distortion: ``[B, G, 4]`` distortion of each cell at each level (HIGH = 0).
        weights: ``[B, G]`` share of the side's KV entries in each cell (0 = unobserved: no upgrades).
        costs: ``[4]`` bytes per entry of each level relative to HIGH.
        order: "distortion" (greedy by distortion removed per byte added) or "random" (seeded).
    Returns the upgrades ``(bucket, group)`` in order.
    """
    level = floors.clone()
    cells = [(b, g) for b in range(floors.shape[0]) for g in range(floors.shape[1]) if weights[b, g] > 0]
    total = sum(int(Precision.HIGH) - int(level[c]) for c in cells)
    if order == "random":
        rng = random.Random(seed)
        steps = [c for c in cells for _ in range(int(Precision.HIGH) - int(level[c]))]
        rng.shuffle(steps)
        return steps
    out = []
    for _ in range(total):
        best, best_gain = None, None
        for c in cells:
            p = int(level[c])
            if p >= int(Precision.HIGH):
                continue
            gain = float(distortion[c][p] - distortion[c][p + 1]) / float(weights[c] * (costs[p + 1] - costs[p]))
            if best_gain is None or gain > best_gain:
                best, best_gain = c, gain
        level[best] += 1
        out.append(best)
    return out


def family_costs(floors: torch.Tensor, upgrades: list[tuple[int, int]], counts: torch.Tensor,
                 group_sizes: torch.Tensor, costs: torch.Tensor) -> torch.Tensor:
    """``[U + 1]`` expected KV fraction of the side's tokens after each prefix of ``upgrades``."""
    side = SideTable(floors, torch.tensor(upgrades, dtype=torch.long).reshape(-1, 2),
                     torch.zeros(len(upgrades) + 1))
    return torch.tensor([expected_fraction(counts, side.actions_at(k), group_sizes, costs)
                         for k in range(len(upgrades) + 1)], dtype=torch.float64)


# ---------------------------------------------------------------------------- the run
class Calibrator:
    """One resumable calibration run (see the module docstring)."""

    def __init__(self, cfg: PASKCalibrationConfig, out: Path, executor, progress: bool = True,
                 log=None, data=None):
        """``data``: the ``calibration.data.DataSplit`` the executor's workers run on (None: the
        synthetic task); its record goes into the settings (a run folder is refused for other data)
        and into the manifest."""
        from calibration.executors import open_run
        from models import resolve_checkpoint
        from replicas.kv_cache import KVCache, KVCacheConfig
        from replicas.models.llama import ModelConfig
        from replicas.policies.pask import level_costs
        self.cfg, self.out, self.ex, self.progress = cfg, Path(out), executor, progress
        self.model_dir = resolve_checkpoint(cfg.model)
        self.data = data
        settings = {**asdict(cfg), "model": str(self.model_dir)}
        if data is not None:
            settings["data_sha256"], settings["dev_ids"] = data.source["sha256"], data.source["dev_ids"]
        self.cache = open_run(self.out, settings)
        mc = ModelConfig.from_hf(json.loads((self.model_dir / "config.json").read_text()))
        self.groups = layer_groups(mc.num_layers, cfg.num_groups)
        self.group_sizes = torch.tensor([b - a for a, b in self.groups])
        kv = KVCache(KVCacheConfig(num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                                   dtype=torch.float32, max_bytes=1 << 20))
        self.costs = level_costs(kv)
        self.log = log or (lambda msg: print(msg, file=sys.stderr))

    # -------------------------------------------------------------- probes
    def _uniform(self, side: str, level: int) -> list[list[int]]:
        return [[level] * len(self.groups) for _ in range(SIDES[side])]

    def _generate_task(self, decode=None, prompt=None, with_outputs=False) -> dict:
        high = int(Precision.HIGH)
        t = {"kind": "generate", "decode": decode or self._uniform("decode", high),
             "prompt": prompt or self._uniform("prompt", high)}
        if with_outputs:
            t["with_outputs"] = True
        return t

    def _run(self, tasks: list[dict], desc: str) -> list[dict]:
        from calibration.executors import run_probes
        return run_probes(self.ex, self.cache, tasks, desc, self.progress)

    def _accuracy(self, result: dict) -> float:
        return sum(result["correct"]) / len(result["correct"])

    def _cell_task(self, side: str, bucket: int, group: int, level: int) -> dict:
        table = self._uniform(side, int(Precision.HIGH))
        table[bucket][group] = level
        return self._generate_task(**{side: table})

    def _counts(self, full: dict) -> dict[str, torch.Tensor]:
        """Per side, the entries of each bucket over the dev set (from the full-KV outputs)."""
        return {"decode": torch.tensor(full["decode_counts"]), "prompt": torch.tensor(full["prompt_counts"])}

    def floors(self, side: str, observed: torch.Tensor, target: float) -> tuple[torch.Tensor, dict]:
        passed: dict[tuple[int, int, int], bool] = {}
        undecided = [(b, g) for b in range(observed.shape[0]) for g in range(observed.shape[1]) if observed[b, g]]
        accuracy = {}
        for level in LEVELS[:-1]:
            if not undecided:
                break
            tasks = [self._cell_task(side, b, g, int(level)) for b, g in undecided]
            results = self._run(tasks, f"{side} floors @ {level.name}")
            still = []
            for (b, g), r in zip(undecided, results):
                acc = self._accuracy(r)
                accuracy[f"{b},{g},{int(level)}"] = acc
                passed[(b, g, int(level))] = acc >= target
                if not passed[(b, g, int(level))]:
                    still.append((b, g))
            undecided = still
        return floors_from_probes(observed, passed), accuracy

    def distortion(self, side: str, observed: torch.Tensor) -> torch.Tensor:
        d = torch.zeros(*observed.shape, len(LEVELS), dtype=torch.float64)
        cells = [(b, g, int(l)) for b in range(observed.shape[0]) for g in range(observed.shape[1])
                 if observed[b, g] for l in LEVELS[:-1]]
        tasks = [{"kind": "distortion", "side": side, "bucket": b, "group": g, "level": l,
                  "examples": self.cfg.distortion_examples} for b, g, l in cells]
        for (b, g, l), r in zip(cells, self._run(tasks, f"{side} distortion")):
            d[b, g, l] = r["distortion"]
        return d

    def select(self, side: str, floors: torch.Tensor, upgrades: list[tuple[int, int]], target: float,
               label: str) -> dict:
        """Bisection for the cheapest candidate (prefix length) with accuracy >= ``target``; the
        full family (all observed cells HIGH) is taken as passing. ``executor.width`` candidates
        are evaluated per round."""
        side_table = SideTable(floors, torch.tensor(upgrades, dtype=torch.long).reshape(-1, 2),
                               torch.zeros(len(upgrades) + 1))
        lo, hi = -1, len(upgrades)   # lo fails (or is below the family), hi passes
        evaluated: dict[int, float] = {}
        while hi - lo > 1:
            width = min(self.ex.width, hi - lo - 1)
            points = sorted({lo + (hi - lo) * (i + 1) // (width + 1) for i in range(width)} - {lo, hi})
            tasks = [self._generate_task(**{side: side_table.actions_at(k).tolist()}) for k in points]
            for k, r in zip(points, self._run(tasks, f"{label} search [{lo + 1}, {hi}]")):
                evaluated[k] = self._accuracy(r)
            passing = [k for k in points if evaluated[k] >= target]
            failing = [k for k in points if evaluated[k] < target]
            new_hi = min(passing, default=hi)
            new_lo = max([k for k in failing if k < new_hi], default=lo)
            lo, hi = new_lo, new_hi
        return {"upgrades": hi, "accuracy": evaluated.get(hi), "evaluated": {str(k): v for k, v in sorted(evaluated.items())}}

    # -------------------------------------------------------------- the whole run
    def run(self):
        """Run every step; return the "pask" ``TableArtifact`` (not yet saved)."""
        from calibration.artifacts import TableArtifact, build_command, model_fingerprint
        cfg, t0 = self.cfg, time.monotonic()
        full = self._run([self._generate_task(with_outputs=True)], "full KV")[0]
        a_full = self._accuracy(full)
        counts = self._counts(full)
        self.log(f"full KV: dev accuracy {a_full:.3f} over {len(full['correct'])} examples")
        tables, meta_sides = {}, {}
        sides = {}
        for side in SIDES:
            observed = (counts[side] > 0)[:, None].expand(-1, len(self.groups)).clone()
            floors, probe_acc = self.floors(side, observed, a_full - cfg.floor_tolerance)
            dist = self.distortion(side, observed)
            weights = counts[side].double()[:, None] * self.group_sizes[None, :].double()
            weights = weights / weights.sum()
            upgrades = build_family(floors, dist, weights, self.costs)
            fam_costs = family_costs(floors, upgrades, counts[side], self.group_sizes, self.costs)
            alpha = cfg.alpha_decode if side == "decode" else cfg.alpha_prompt
            target = (1 - alpha) * a_full
            chosen = self.select(side, floors, upgrades, target, f"{side} (PASK)")
            chosen["budget"] = float(fam_costs[chosen["upgrades"]])
            sides[side] = SideTable(floors, torch.tensor(upgrades, dtype=torch.long).reshape(-1, 2), fam_costs)
            tables[f"{side}_distortion"] = dist.float()
            meta_sides[side] = {"counts": counts[side].tolist(), "floor_probe_accuracy": probe_acc,
                                "selected": chosen, "target_accuracy": target, "alpha": alpha,
                                "floor_cost": float(fam_costs[0])}
            self.log(f"{side}: floors cost {float(fam_costs[0]):.3f}, selected {chosen['upgrades']} / "
                     f"{len(upgrades)} upgrades at KV fraction {chosen['budget']:.3f} (dev accuracy {chosen['accuracy']})")
            if side == "decode":
                ablations = {"pask": chosen}
                no_floor = torch.where(observed, torch.zeros_like(floors), floors)
                up_nf = build_family(no_floor, dist, weights, self.costs)
                r = self.select(side, no_floor, up_nf, target, "decode (no floors)")
                r["budget"] = float(family_costs(no_floor, up_nf, counts[side], self.group_sizes, self.costs)[r["upgrades"]])
                ablations["no_floors"] = r
                up_nr = build_family(floors, dist, weights, self.costs, order="random", seed=cfg.seed)
                r = self.select(side, floors, up_nr, target, "decode (no ranking)")
                r["budget"] = float(family_costs(floors, up_nr, counts[side], self.group_sizes, self.costs)[r["upgrades"]])
                ablations["no_ranking"] = r
                meta_sides["ablation"] = ablations
                self.log("ablation (decode budget to meet the gate): " + ", ".join(
                    f"{k} {v['budget']:.3f}" for k, v in ablations.items()))
        table = PASKTable(sides["decode"], sides["prompt"], self.groups)
        both = self._generate_task(decode=table.decode.actions_at(meta_sides["decode"]["selected"]["upgrades"]).tolist(),
                                   prompt=table.prompt.actions_at(meta_sides["prompt"]["selected"]["upgrades"]).tolist())
        combined = self._run([both], "selected table")[0]
        tables.update(table.to_tables())
        meta = {"buckets": list(BUCKETS), "prompt_buckets": list(PROMPT_BUCKETS), "levels": [l.name for l in LEVELS],
                "level_costs": self.costs.tolist(), "kv_dtype": "float32",
                "layer_groups": [list(g) for g in self.groups],
                "data": ({"split": "dev", "categories": list(cfg.categories), "per_category": cfg.per_category,
                          "grammar": "tools", "decoding": "greedy"} if self.data is None
                         else {**self.data.source, "grammar": "per example (tools or json_schema)", "decoding": "greedy"}),
                "settings": {k: v for k, v in asdict(cfg).items() if k != "model"},
                "full_kv_accuracy": a_full, "sides": meta_sides,
                "selected": {"accuracy": self._accuracy(combined), "kv_ratio": combined["kv_ratio"]},
                "build_command": build_command("pask", cfg, self.model_dir, self.out, CLI_SETTINGS,
                                               {"categories": ","}),
                "wall_s": round(time.monotonic() - t0, 1)}
        return TableArtifact("pask", tables, model_fingerprint(self.model_dir), meta)


def main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m calibration pask", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="HF checkpoint folder")
    ap.add_argument("--out", type=Path, required=True, help="artifact folder (also holds the resumable probe log)")
    ap.add_argument("--executor", choices=("ray", "local"), default="ray")
    ap.add_argument("--workers", type=int, default=2, help="Ray actors")
    ap.add_argument("--num-groups", type=int, default=3)
    ap.add_argument("--per-category", type=int, default=8)
    ap.add_argument("--categories", default=",".join(DEFAULT_CATEGORIES))
    ap.add_argument("--floor-tolerance", type=float, default=0.02)
    ap.add_argument("--alpha-decode", type=float, default=0.05)
    ap.add_argument("--alpha-prompt", type=float, default=0.02)
    ap.add_argument("--distortion-examples", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0, help="seed of the ablation order and of the data split")
    ap.add_argument("--data", help="calibrate on this file (BFCL questions or OpenAI-style JSONL, see "
                    "calibration/data.py) instead of the synthetic task; --categories / --per-category then do not apply")
    ap.add_argument("--answers", help="BFCL possible-answer file (default: possible_answer/<name> beside --data)")
    ap.add_argument("--data-format", choices=("auto", "bfcl", "openai"), default="auto")
    ap.add_argument("--gpus-per-worker", type=float, default=0, help="GPUs each Ray worker reserves (0: the "
                    "workers' engines run on CPU; 1 for a real checkpoint on a GPU cluster)")
    ap.add_argument("--dev-fraction", type=float, default=0.5, help="share of the examples calibrated on; the rest is held out")
    ap.add_argument("--limit", type=int, help="read only the first N examples of --data")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--publish", action="store_true", help="publish the artifact to the cluster's table "
                    "registry when done (replicas with budget_controller on switch to it)")
    ap.add_argument("--version", help="version name when publishing (default: a timestamp)")
    ap.add_argument("--address", help="Ray cluster to run on and publish to (default: RAY_ADDRESS, as set "
                    "by `ray job submit`; else a local Ray instance)")
    args = ap.parse_args(argv)
    import os
    if args.publish and not (args.address or os.environ.get("RAY_ADDRESS")):
        ap.error("--publish needs a running cluster: pass --address, or submit with `ray job submit`")
    from models import CheckpointNotFoundError, resolve_checkpoint, synth
    cats = tuple(c for c in args.categories.split(",") if c)
    bad = [c for c in cats if c not in synth.CATEGORIES]
    if bad or not cats:
        ap.error(f"unknown categories {bad}; choose from {', '.join(synth.CATEGORIES)}")
    try:
        model_dir = resolve_checkpoint(args.model)
    except CheckpointNotFoundError as e:
        ap.error(str(e))
    from calibration.data import cli_split
    data = cli_split(ap, args)   # before anything is written: bad data leaves no run folder
    if data is False:
        return 2
    cfg = PASKCalibrationConfig(str(model_dir), args.num_groups, args.per_category, cats, args.floor_tolerance,
                                args.alpha_decode, args.alpha_prompt, args.distortion_examples,
                                args.max_new_tokens, args.seed,
                                *((data.source["path"], data.source["answers"], args.data_format, args.dev_fraction,
                                   args.limit) if data else ()))
    worker_args = (str(model_dir), list(cats), args.per_category, args.num_groups, args.max_new_tokens,
                   data.dev if data else None)
    from calibration.executors import make_executor
    executor = make_executor(args.executor, ProbeWorker, worker_args, args.workers, args.address,
                             args.gpus_per_worker)
    try:
        cal = Calibrator(cfg, args.out, executor, progress=not args.no_progress, data=data)
        artifact = cal.run()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        executor.close()
    artifact.save(args.out)
    sel = artifact.meta["selected"]
    print(f"wrote {args.out}: dev accuracy {sel['accuracy']:.3f} at KV ratio {sel['kv_ratio']:.3f} "
          f"(full KV {artifact.meta['full_kv_accuracy']:.3f})"
          + (f"; {data.source['dev']} dev / {data.source['held_out']} held-out examples of {args.data}" if data else ""))
    if args.publish:
        import ray

        from cluster.control import publish_artifact
        if not ray.is_initialized():
            ray.init(address=args.address, log_to_driver=False)
        print(f"published pask table {publish_artifact(args.out, 'pask', version=args.version)}")
    return 0
