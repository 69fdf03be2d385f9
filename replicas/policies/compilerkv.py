"""CompilerKV: risk-adaptive, head-aware prefill compression from compiled tables.

Source: CompilerKV (design section 5). After prefill, each layer scores the prompt tokens:

1. *Stabilized token utility* (5.1): per query head, the attention the last ``window`` prompt
   tokens pay to each token, summed over the window, average-pooled over ``kernel`` neighbours
   (21 by default: chosen on development prompts, see ``docs/compilerkv.md``),
   times the token's value norm relative to the mean value norm of that head; normalized per head.
2. *Head heterogeneity* (5.2): head utilities combined with weights ``W_head[budget, layer, head]``.
3. *Risk gate* (5.3): from the window's mean normalized attention entropy (``E`` bins on [0, 1])
   and the local perplexity of the window tokens (``P`` bins), a threshold
   ``T = T_gate[budget, layer, e, p]``: the layer keeps the fewest top-scoring tokens whose score
   mass reaches ``T``, clamped to the top-``B`` (5.4). The observation window is always kept.

Prefill only: generated tokens are kept at HIGH (``kv_budget`` 1.0) or left to PASK in the combined
policy. The tables come from ``python -m calibration compilerkv``; the ones shipped for the served
model are used by default, and a model without tables runs with W = 1 and T = 1 (a plain pooled,
value-weighted SnapKV-style top-B).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from replicas.kv_cache import KVCache, Precision
from replicas.policies.base import check_prefill_tokens
from replicas.policy import KVAction, KVPolicy, PrefillView
from replicas.sequence import Sequence


DEFAULT_KERNEL = 21  # pooling width; chosen on dev long_context prompts (docs/compilerkv.md)


def token_utility(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  k_pos: torch.Tensor, kernel: int = DEFAULT_KERNEL) -> tuple[torch.Tensor, float]:
    """Stabilized per-head utility of every kept token, and the window's attention entropy.

    Args:
        q: ``[w, Hq, D]`` window queries (after RoPE) at positions ``q_pos [w]``.
        k, v: ``[n, Hkv, D]`` keys (after RoPE) and values at positions ``k_pos [n]``.
        kernel: odd average-pooling width over neighbouring tokens (1 = none).
    Returns:
        ``(utility [Hq, n] float32 on the CPU, each row summing to 1; entropy in [0, 1])``, the entropy the
        mean over heads and queries of the attention entropy divided by log(visible keys).
    Raises:
        ValueError: mismatched shapes or an even ``kernel``.
    """
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"kernel must be a positive odd width, got {kernel}")
    if q.dim() != 3 or k.shape != v.shape or q.shape[-1] != k.shape[-1] or q.shape[1] % k.shape[1]:
        raise ValueError(f"bad shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    groups = q.shape[1] // k.shape[1]
    q_pos, k_pos = q_pos.to(q.device), k_pos.to(q.device)
    keys = k.float().repeat_interleave(groups, dim=1).transpose(0, 1)          # [Hq, n, D]
    scores = q.float().transpose(0, 1) @ keys.transpose(1, 2) / math.sqrt(q.shape[-1])  # [Hq, w, n]
    visible = k_pos[None, :] <= q_pos[:, None]                                  # [w, n]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    probs = scores.softmax(-1)
    ent = -(probs * probs.clamp_min(1e-12).log()).sum(-1)                       # [Hq, w]
    ent = ent / visible.sum(-1).clamp_min(2).log()[None, :]
    attn = probs.sum(1)                                                         # [Hq, n]
    if kernel > 1:
        attn = F.avg_pool1d(attn[:, None, :], kernel, stride=1, padding=kernel // 2,
                            count_include_pad=False)[:, 0, :]
    vnorm = v.float().norm(dim=-1).transpose(0, 1).repeat_interleave(groups, dim=0)  # [Hq, n]
    util = attn * (vnorm / vnorm.mean(-1, keepdim=True).clamp_min(1e-12))
    util = util / util.sum(-1, keepdim=True).clamp_min(1e-12)
    return util.cpu(), float(ent.mean())


def gated_keep_count(scores: torch.Tensor, threshold: float, max_tokens: int) -> int:
    """Fewest top tokens whose share of ``scores [n]`` (non-negative) reaches ``threshold``,
    clamped to ``[1, max_tokens]``."""
    total = float(scores.sum())
    if total <= 0:
        return max(1, min(max_tokens, scores.numel()))
    mass = torch.sort(scores, descending=True).values.cumsum(0) / total
    need = int(torch.searchsorted(mass, torch.tensor([threshold - 1e-9], dtype=mass.dtype)).item()) + 1
    return max(1, min(need, max_tokens, scores.numel()))


def gate_record(policy_state: dict, budget_tokens: int) -> dict[int, dict]:
    """Per layer of a sequence CompilerKV compressed at ``budget_tokens``: its ``threshold``, the
    tokens the gate asks for (``gated``) and the room the top-B clamp leaves beside the window
    (``clamp``); the gate set the layer's kept count only where ``gated < clamp``. Computed from
    what :meth:`CompilerKVPolicy.prefill_actions` records (a diagnostic, off the serving path)."""
    out = {}
    for layer, threshold in policy_state.get("ckv_threshold", {}).items():
        scores = policy_state["ckv_scores"][layer]
        window = torch.isinf(scores)
        free = scores.masked_fill(window, 0.0)
        out[layer] = {"threshold": threshold, "gated": gated_keep_count(free, threshold, free.numel()),
                      "clamp": max(0, budget_tokens - int(window.sum()))}
    return out


def combine_heads(util: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per-token score ``[n]``: head utilities ``[Hq, n]`` averaged with head weights ``[Hq]``."""
    return (weights.float()[:, None] * util).sum(0) / weights.float().sum()


def select_tokens(score: torch.Tensor, protected: torch.Tensor, threshold: float, budget_tokens: int) -> torch.Tensor:
    """Keep mask ``[n]`` (design 5.4): the ``protected`` tokens (observation window), then the
    fewest top-scoring others whose score mass reaches ``threshold``, at most ``budget_tokens`` in all."""
    free = max(0, budget_tokens - int(protected.sum()))
    keep = protected.clone()
    keep_n = min(gated_keep_count(score.masked_fill(protected, 0.0), threshold, max(free, 1)), free)
    if keep_n:
        keep[torch.topk(score.masked_fill(protected, -1.0), keep_n).indices] = True
    return keep


@dataclass
class CompilerKVTables:
    """Compiled tables (a ``calibration.artifacts.TableArtifact`` of kind "compilerkv").

    Attributes:
        budgets: ``[NB]`` token budgets the tables were compiled for (rising).
        head_weights: ``[NB, L, Hq]`` float, about 0.8 .. 1.5.
        gate: ``[NB, L, E, P]`` float thresholds, about 0.8 .. 1.0.
        entropy_edges: ``[E - 1]`` inner bin edges of the normalized entropy.
        ppl_edges: ``[P - 1]`` inner bin edges of the window perplexity.
        gate_visits: ``[NB, L, E, P]`` calibration rollouts per gate cell (None in tables built
            before it was recorded); unvisited cells hold the default threshold 1.0.
    """
    budgets: torch.Tensor
    head_weights: torch.Tensor
    gate: torch.Tensor
    entropy_edges: torch.Tensor
    ppl_edges: torch.Tensor
    gate_visits: torch.Tensor | None = None

    def __post_init__(self):
        nb = len(self.budgets)
        if self.head_weights.dim() != 3 or self.head_weights.shape[0] != nb:
            raise ValueError(f"head_weights must be [{nb}, L, Hq], got {tuple(self.head_weights.shape)}")
        e, p = len(self.entropy_edges) + 1, len(self.ppl_edges) + 1
        want = (nb, self.head_weights.shape[1], e, p)
        if tuple(self.gate.shape) != want:
            raise ValueError(f"gate must be {list(want)} (budgets, layers, entropy bins, perplexity bins), "
                             f"got {list(self.gate.shape)}")
        if self.gate_visits is not None and self.gate_visits.shape != self.gate.shape:
            raise ValueError(f"gate_visits must have the gate's shape {list(want)}, got {list(self.gate_visits.shape)}")

    def index(self, budget_tokens: int) -> int:
        """Row of the nearest compiled budget."""
        return int((self.budgets.float() - budget_tokens).abs().argmin())

    def lookup(self, budget_tokens: int, layer: int, entropy: float, ppl: float) -> tuple[torch.Tensor, float]:
        """(head weights ``[Hq]``, threshold) for one layer of one prompt."""
        b = self.index(budget_tokens)
        e = int(torch.bucketize(torch.tensor(entropy), self.entropy_edges))
        p = int(torch.bucketize(torch.tensor(ppl), self.ppl_edges))
        return self.head_weights[b, layer], float(self.gate[b, layer, e, p])

    def mean_threshold(self, budget_tokens: int) -> float:
        """The gate's mean threshold at the nearest compiled budget, weighted by how often
        calibration prompts fell in each cell (the plain mean over cells without ``gate_visits``)."""
        b = self.index(budget_tokens)
        gate = self.gate[b].double()
        if self.gate_visits is None or float(self.gate_visits[b].sum()) <= 0:
            return float(gate.mean())
        w = self.gate_visits[b].double()
        return float((gate * w).sum() / w.sum())

    def to_tables(self) -> dict[str, torch.Tensor]:
        t = {"budgets": self.budgets, "head_weights": self.head_weights, "gate": self.gate,
             "entropy_edges": self.entropy_edges, "ppl_edges": self.ppl_edges}
        return t if self.gate_visits is None else {**t, "gate_visits": self.gate_visits}

    @classmethod
    def from_tables(cls, t: dict[str, torch.Tensor]) -> "CompilerKVTables":
        return cls(t["budgets"], t["head_weights"], t["gate"], t["entropy_edges"], t["ppl_edges"],
                   t.get("gate_visits"))


@dataclass
class CompilerKVPolicy(KVPolicy):
    """Attributes:
        prefill_tokens: prompt tokens each layer keeps at most (B); None: all.
        prefill_fraction: B as a fraction of the prompt instead (exclusive with ``prefill_tokens``).
        window: observation window (last prompt tokens; always kept).
        kernel: pooling width of the utility (odd); None: the width the tables were compiled
            with (their manifest's ``settings.kernel``), ``DEFAULT_KERNEL`` without tables.
        tables: :class:`CompilerKVTables`, an artifact folder, or None (the tables shipped for
            the model, when there are some; else W = 1, T = 1).
        use_head_weights / use_gate: ablation switches (False = W = 1 / T = ``fixed_threshold``).
        fixed_threshold: the threshold with ``use_gate=False``; None = the compiled gate's mean at
            the budget, weighted by calibration visits (the same average strictness, without risk
            adaptation), 1.0 without tables.
    """
    prefill_tokens: int | None = None
    prefill_fraction: float | None = None
    window: int = 32
    kernel: int | None = None
    tables: CompilerKVTables | str | None = None
    use_head_weights: bool = True
    use_gate: bool = True
    fixed_threshold: float | None = None
    name = "compilerkv"
    prompt_only = True
    _loaded: bool = field(default=False, repr=False)

    def __post_init__(self):
        check_prefill_tokens(self.prefill_tokens)
        if self.prefill_fraction is not None:
            if self.prefill_tokens is not None:
                raise ValueError("give prefill_tokens or prefill_fraction, not both")
            if not 0.0 < self.prefill_fraction <= 1.0:
                raise ValueError(f"prefill_fraction must be in (0, 1], got {self.prefill_fraction}")
        if self.window < 1:
            raise ValueError(f"window must be positive, got {self.window}")
        if self.kernel is not None and (type(self.kernel) is not int or self.kernel < 1 or self.kernel % 2 == 0):
            raise ValueError(f"kernel must be a positive odd int width, got {self.kernel!r}")
        if self.fixed_threshold is not None:
            if self.use_gate:
                raise ValueError("fixed_threshold replaces the gate: set use_gate=False with it")
            if not 0.0 < self.fixed_threshold <= 1.0:
                raise ValueError(f"fixed_threshold must be in (0, 1], got {self.fixed_threshold}")
        self.observation_window = self.window
        self.wants_window_ppl = True

    def bind_model(self, model_dir) -> None:
        """Load ``tables`` when given as a folder, or the ones shipped for ``model_dir`` when None
        (validated against the model: a wrong fingerprint or checksum raises ``ArtifactError``)."""
        if self.tables is None:
            from calibration import shipped_table
            if (shipped_table("compilerkv", model_dir) / "manifest.json").is_file():
                self.tables = str(shipped_table("compilerkv", model_dir))
        if isinstance(self.tables, str):
            from calibration.artifacts import load_artifact
            artifact = load_artifact(self.tables, "compilerkv", model_dir)
            self.tables = CompilerKVTables.from_tables(artifact.tables)
            if self.kernel is None:  # the width the tables were compiled with
                self.kernel = int(artifact.meta.get("settings", {}).get("kernel", DEFAULT_KERNEL))

    def check(self, num_prompt_tokens: int, budget: float, kv: KVCache) -> None:
        if budget < 1.0:
            raise ValueError("compilerkv compresses the prompt only (prefill_tokens) and keeps generated tokens: "
                             "use kv_budget 1.0, or the compilerkv+pask policy for a total budget")

    def keep_tokens(self, num_prompt: int) -> int:
        b = self.prefill_tokens if self.prefill_tokens is not None else num_prompt
        if self.prefill_fraction is not None:
            b = math.floor(self.prefill_fraction * num_prompt)
        return max(1, min(b, num_prompt))

    def layer_scores(self, view: PrefillView, layer: int, budget_tokens: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(kept positions ``[n]``, combined score ``[n]``, threshold) of one layer."""
        positions, k, v = view.kv.gather(view.seq.request_id, layer)[:3]
        q = view.queries[layer]
        n = view.num_prefilled
        q_pos = torch.arange(n - q.shape[0], n)
        util, entropy = token_utility(q, q_pos, k, v, positions.cpu(), self.kernel or DEFAULT_KERNEL)
        weights, threshold = torch.ones(util.shape[0]), 1.0
        if isinstance(self.tables, CompilerKVTables):
            w, t = self.tables.lookup(budget_tokens, layer, entropy, view.window_ppl or 1.0)
            if self.use_head_weights:
                weights = w.float()
            threshold = t if self.use_gate else self.tables.mean_threshold(budget_tokens)
        if not self.use_gate and self.fixed_threshold is not None:
            threshold = self.fixed_threshold
        return positions.cpu(), combine_heads(util, weights), threshold

    def on_prefill(self, view: PrefillView) -> list[KVAction]:
        # A preempted sequence is recomputed with its outputs: B applies to the prompt, outputs stay.
        num_prompt = min(len(view.seq.prompt_token_ids), view.num_prefilled)
        generated = view.num_prefilled - num_prompt
        return self.prefill_actions(view, self.keep_tokens(num_prompt) + generated, keep_from=num_prompt)

    def prefill_actions(self, view: PrefillView, budget_tokens: int, keep_from: int | None = None) -> list[KVAction]:
        """Release, per layer, every prompt token outside the window and the gated top tokens,
        keeping at most ``budget_tokens`` per layer; positions from ``keep_from`` on (generated
        tokens of a recomputed sequence) are kept as the window is.

        Records per layer in ``seq.policy_state``: ``ckv_scores`` (``[n]`` float32 score by position, inf for the
        window) and ``ckv_threshold`` (see :func:`gate_record`)."""
        n = view.num_prefilled
        if budget_tokens >= n:
            return []
        prompt_budget = budget_tokens - (n - keep_from if keep_from is not None else 0)  # picks the table row
        actions = []
        for layer in range(view.kv.cfg.num_layers):
            positions, score, threshold = self.layer_scores(view, layer, prompt_budget)
            protected = positions >= n - min(self.window, budget_tokens)
            if keep_from is not None:
                protected |= positions >= keep_from
            by_position = torch.full((n,), float("inf"))
            by_position[positions] = score.float().masked_fill(protected, float("inf"))
            view.seq.policy_state.setdefault("ckv_scores", {})[layer] = by_position
            view.seq.policy_state.setdefault("ckv_threshold", {})[layer] = threshold
            drop = positions[~select_tokens(score, protected, threshold, budget_tokens)]
            if drop.numel():
                actions.append(KVAction(layer, tuple(drop.tolist()), Precision.RELEASED))
        state = view.seq.policy_state   # [L, n], for the decode-time budget (PromptPages)
        state["ckv_score_stack"] = torch.stack([state["ckv_scores"][layer] for layer in range(view.kv.cfg.num_layers)])
        state["ckv_releasable"] = ~torch.isinf(state["ckv_score_stack"])   # [L, n] outside the window
        return actions

    def prompt_pages(self, seq: Sequence, kv: KVCache) -> "PromptPages":
        """The sequence's prompt entries as one budget event sees them (:class:`PromptPages`)."""
        return PromptPages(seq, kv)


class PromptPages:
    """A sequence's prompt entries during one budget event of a composed policy
    (``replicas.policies.composed``): the share the cache still keeps and the releases that bring
    it down, a page at a time.

    Made once per event from the cache's kept mask, then kept in step with the releases it makes
    (nothing else changes prompt entries within an event: the decode side demotes generated
    tokens only), so that each release reads no cache-wide mask.

    Attributes:
        share: share of the prompt's (position, layer) entries the cache keeps, in [0, 1].
    """

    def __init__(self, seq: Sequence, kv: KVCache):
        self.seq, self.kv = seq, kv
        state = seq.policy_state
        self.scores = state.get("ckv_score_stack")                                    # [L, n] or None
        prompt_len = seq.num_prompt_tokens
        n = 0 if self.scores is None else self.scores.shape[1]
        kept = kv.kept_mask(seq.request_id, max(prompt_len, n))                        # [L, max] bool
        self._kept = int(kept[:, :prompt_len].sum())
        self._total = max(1, prompt_len * kv.cfg.num_layers)
        self.share = self._kept / self._total
        if self.scores is not None:
            self.droppable = kept[:, :n] & state["ckv_releasable"]                    # [L, n]
            self.counts = self.droppable.sum(1)                                       # [L]

    def release_page(self) -> bool:
        """Release one page (``block_size`` entries) of the lowest-scoring prompt tokens outside
        the window, from the layer that holds the most of them (the first such layer on a tie;
        scores recorded by :meth:`CompilerKVPolicy.prefill_actions`), the lowest position first
        among equal scores. Returns False when no layer has such a token left."""
        if self.scores is None:
            return False
        layer = int(self.counts.argmax())                                            # (the first maximum)
        if not int(self.counts[layer]):
            return False
        positions = self.droppable[layer].nonzero().flatten()
        order = torch.sort(self.scores[layer][positions], stable=True).indices
        chosen = positions[order[: self.kv.cfg.block_size]]
        self.kv.set_precision(self.seq.request_id, layer, chosen, Precision.RELEASED)
        self.droppable[layer, chosen] = False
        self.counts[layer] -= chosen.numel()
        self._kept -= chosen.numel()
        self.share = self._kept / self._total
        return True
