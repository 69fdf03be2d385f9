"""Shared machinery of score-based eviction policies (kvpress's ``ScorerPress`` pattern).

A policy scores every kept token of every layer (higher = keep); after prefill and after each
decode step, each layer keeps its highest-scoring tokens within its share of the total budget.

Budget (see ``docs`` and design section 6): a sequence of ``n`` tokens may hold at most
``floor(b * L * ceil(n / block_size))`` pages over its ``L`` layers, i.e. bytes held / bytes full
KV would hold <= b, checked after every step. :meth:`ScoredPolicy.layer_split` splits the pages over
layers (uniformly here; PyramidKV overrides it).

Prefill budget (``prefill_tokens = B``, the KV-size setting of the SnapKV / PyramidKV LongBench
experiments): after prefill each layer keeps ``B`` prompt tokens (on average over layers, for
PyramidKV); each generated token then adds one to every layer's quota (``B + generated``). SnapKV,
PyramidKV, StreamingLLM and recency rank generated tokens first, so they keep them all; H2O and
random choose among all tokens by their own scores. The total budget must be 1.0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from replicas.kv_cache import KVCache, Precision
from replicas.policy import DecodeView, KVAction, KVPolicy, PrefillView
from replicas.sequence import Sequence

KEEP = 1e30  # score of tokens a policy protects (sinks, observation window ...)


def total_pages(budget: float, num_layers: int, num_tokens: int, block_size: int) -> int:
    """Pages a sequence of ``num_tokens`` may hold over all layers at total budget ``budget``."""
    return math.floor(budget * num_layers * math.ceil(num_tokens / block_size) + 1e-9)


def split_evenly(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def cap_and_refill(shares: list[int], cap: int) -> list[int]:
    """Cap every layer's share at ``cap`` units and spread the excess evenly over the layers still
    under it (the remainder to the largest first), so the total is kept while it fits under the
    caps. PyramidKV's first layers can be given more than a short prompt has."""
    out = [min(s, cap) for s in shares]
    excess = sum(shares) - sum(out)
    while excess > 0:   # each round fills a layer or hands out all the excess: at most L rounds
        under = sorted((i for i, s in enumerate(out) if s < cap), key=lambda i: -out[i])
        if not under:
            break
        each, extra = divmod(excess, len(under))
        for rank, i in enumerate(under):
            give = min(cap - out[i], each + (rank < extra))
            out[i] += give
            excess -= give
    return out


def check_prefill_tokens(value) -> None:
    """Raises ValueError unless ``value`` is None or a positive int (a prefill budget in tokens)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"prefill_tokens must be a positive int, got {value!r}")


def attention_probs(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, k_pos: torch.Tensor,
                    chunk: int = 256) -> torch.Tensor:
    """Causal softmax attention of queries over keys, summed over query heads and queries.

    Args:
        q: ``[w, Hq, D]`` queries at positions ``q_pos [w]``; k: ``[n, Hkv, D]`` at ``k_pos [n]``.
    Returns ``[n]`` float32 on the CPU: total attention each key received.
    """
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    q_pos, k_pos = q_pos.to(q.device), k_pos.to(q.device)
    keys = k.float().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)      # [Hq, n, D]
    total = torch.zeros(k.shape[0], dtype=torch.float32)
    for s in range(0, q.shape[0], chunk):
        qc = q[s:s + chunk].float().transpose(0, 1)                             # [Hq, c, D]
        scores = qc @ keys.transpose(1, 2) / math.sqrt(d)                      # [Hq, c, n]
        future = k_pos[None, :] > q_pos[s:s + chunk, None]
        scores = scores.masked_fill(future[None], float("-inf"))
        total += scores.softmax(-1).sum(dim=(0, 1)).cpu()
    return total


@dataclass
class ScoredPolicy(KVPolicy):
    """Keep the top-scoring tokens of each layer within its quota.

    Attributes:
        prefill_tokens: None (default): the quota is the layer's share of the total budget, in
            pages. An int ``B``: prompt tokens each layer keeps (see the module docstring);
            keyword only.

    ``block_size`` (tokens per page) is set by the engine from its KV cache.

    Subclasses fill ``seq.policy_state["scores"][layer]``, a float tensor indexed by position:
    :meth:`prefill_scores` after prefill, :meth:`decode_score` for each new token (and may update
    earlier scores, as H2O does, in :meth:`observe_decode`).
    """

    prefill_tokens: int | None = field(default=None, kw_only=True)
    block_size = 16

    def __post_init__(self):
        check_prefill_tokens(self.prefill_tokens)

    def layer_split(self, num_layers: int, units: int, unit_tokens: int) -> list[int]:
        """Split ``units`` (of ``unit_tokens`` tokens each: pages, or single tokens) over layers."""
        return split_evenly(units, num_layers)

    def layer_quotas(self, seq: Sequence, num_layers: int, budget: float, num_tokens: int) -> list[int]:
        """Tokens each layer may keep when the sequence has ``num_tokens`` tokens. No layer is
        given more than there is to keep (see :func:`cap_and_refill`)."""
        if self.prefill_tokens is None:
            pages = total_pages(budget, num_layers, num_tokens, self.block_size)
            split = self.layer_split(num_layers, pages, self.block_size)
            split = cap_and_refill(split, math.ceil(num_tokens / self.block_size))
            return [p * self.block_size for p in split]
        num_prompt = min(len(seq.prompt_token_ids), num_tokens)
        split = cap_and_refill(self.layer_split(num_layers, self.prefill_tokens * num_layers, 1), num_prompt)
        return [b + num_tokens - num_prompt for b in split]

    @property
    def prompt_only(self) -> bool:
        """True with ``prefill_tokens``: the engine then holds the request at budget 1.0 (a lower
        replica budget would only make it release the oldest pages)."""
        return self.prefill_tokens is not None

    def min_tokens_per_layer(self) -> int:
        """Tokens every layer must be able to keep (e.g. attention sinks)."""
        return 1

    def check(self, num_prompt_tokens: int, budget: float, kv: KVCache) -> None:
        cfg = kv.cfg
        self.block_size = cfg.block_size
        if self.prefill_tokens is not None:
            if budget < 1.0:
                raise ValueError(f"policy {self.name!r} with prefill_tokens compresses the prompt only and "
                                 f"keeps generated tokens: use kv_budget 1.0 (got {budget})")
            fewest = min(self.layer_split(cfg.num_layers, self.prefill_tokens * cfg.num_layers, 1))
            if fewest < min(self.min_tokens_per_layer(), num_prompt_tokens):
                raise ValueError(f"policy {self.name!r} needs {self.min_tokens_per_layer()} tokens per layer, but "
                                 f"prefill_tokens {self.prefill_tokens} leaves {fewest} in some layer")
            return
        pages = total_pages(budget, cfg.num_layers, num_prompt_tokens, cfg.block_size)
        fewest = min(self.layer_split(cfg.num_layers, pages, cfg.block_size)) * cfg.block_size
        if fewest < self.min_tokens_per_layer():
            raise ValueError(f"policy {self.name!r} needs {self.min_tokens_per_layer()} tokens per layer, but a "
                             f"budget of {budget} on a {num_prompt_tokens}-token prompt leaves {fewest} "
                             f"in some layer ({pages} pages of {cfg.block_size} tokens over {cfg.num_layers} layers)")

    def prefill_scores(self, view: PrefillView, layer: int, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def decode_score(self, view: DecodeView, layer: int) -> float:
        """Score of the new token (default: recency, below protected tokens)."""
        return float(view.position)

    def observe_decode(self, view: DecodeView) -> None:
        """Hook for policies that update scores from decode attention."""

    def protected(self, seq: Sequence, layer: int, positions: torch.Tensor, num_tokens: int,
                  quota_tokens: int) -> torch.Tensor | None:
        """Boolean mask of ``positions`` kept before any scored token (e.g. a recent window)."""
        return None

    # -------------------------------------------------------------- hooks of the engine
    def on_prefill(self, view: PrefillView) -> list[KVAction]:
        n = view.num_prefilled
        positions = torch.arange(n)
        view.seq.policy_state["scores"] = {
            layer: self.prefill_scores(view, layer, positions).float().cpu()
            for layer in range(view.kv.cfg.num_layers)}
        return self.fit(view.seq, view.kv, view.budget, n)

    def on_decode(self, view: DecodeView) -> list[KVAction]:
        scores = view.seq.policy_state["scores"]
        for layer in range(view.kv.cfg.num_layers):
            new = torch.tensor([self.decode_score(view, layer)])
            gap = view.position - scores[layer].shape[0]
            pad = torch.full((gap,), float("-inf")) if gap > 0 else torch.empty(0)
            scores[layer] = torch.cat([scores[layer], pad, new])
        self.observe_decode(view)
        return self.fit(view.seq, view.kv, view.budget, view.position + 1)

    def fit(self, seq: Sequence, kv: KVCache, budget: float, num_tokens: int) -> list[KVAction]:
        """Release, in every layer, the lowest-scoring tokens above the layer's quota."""
        cfg = kv.cfg
        self.block_size = cfg.block_size
        scores = seq.policy_state["scores"]
        actions = []
        for layer, quota in enumerate(self.layer_quotas(seq, cfg.num_layers, budget, num_tokens)):
            kept = kv.kept(seq.request_id, layer)
            if len(kept) <= quota:
                continue
            pos = torch.tensor(sorted(kept), dtype=torch.long)
            s = scores[layer][pos].clone()
            mask = self.protected(seq, layer, pos, num_tokens, quota)
            if mask is not None:
                s[mask] = KEEP + pos[mask].float()
            drop = torch.topk(-s, len(pos) - quota).indices
            actions.append(KVAction(layer, tuple(pos[drop].tolist()), Precision.RELEASED))
        return actions
