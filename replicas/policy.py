"""The KV policy interface: a policy decides what the KV cache keeps; the engine carries it out.

Modelled on NVIDIA kvpress: one small class per method, configured by dataclass fields. Two hooks:

- :meth:`KVPolicy.on_prefill`, after a sequence's prompt is in the cache: which prompt tokens each
  layer keeps, and at which precision;
- :meth:`KVPolicy.on_decode`, after each decode step: the precision of the step's new token per
  layer (group), and what to demote or release when the sequence is over its budget.

Both return :class:`KVAction` s; the engine applies them with ``KVCache.set_precision``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replicas.kv_cache import KVCache, Precision
from replicas.sequence import Sequence


@dataclass(frozen=True)
class KVAction:
    """Set ``positions`` of (sequence, ``layer``) to ``precision`` (demote or release only)."""
    layer: int
    positions: tuple[int, ...]
    precision: Precision


@dataclass
class PrefillView:
    """What a policy sees after prefill.

    Attributes:
        seq: the sequence (its ``policy_state`` is the policy's to use).
        kv: the cache (read entries with ``kv.gather`` / ``kv.kept``).
        num_prefilled: tokens just prefilled (prompt, plus earlier outputs after a preemption).
        queries: layer -> ``[w, Hq, D]`` queries of the last ``w = observation_window`` prefilled
            tokens (after RoPE), when the policy asked for them.
        budget: the total KV budget of this sequence (fraction of full KV).
        window_ppl: perplexity of the observation-window tokens, when the policy sets
            ``wants_window_ppl`` (else None).
    """
    seq: Sequence
    kv: KVCache
    num_prefilled: int
    queries: dict[int, torch.Tensor]
    budget: float
    window_ppl: float | None = None


@dataclass
class DecodeView:
    """What a policy sees after a decode step of one sequence (``position`` is the new token's;
    ``queries``: layer -> ``[Hq, D]`` query of that token, when the policy asked for them)."""
    seq: Sequence
    kv: KVCache
    position: int
    budget: float
    queries: dict[int, torch.Tensor]


class KVPolicy:
    """Base class. ``observation_window``: prompt queries to record per layer for ``on_prefill``;
    ``record_decode_queries``: pass each decode step's queries to ``on_decode``."""
    name = "base"
    observation_window = 0
    record_decode_queries = False

    def check(self, num_prompt_tokens: int, budget: float, kv: KVCache) -> None:
        """Refuse, before any work, a request whose budget this policy cannot meet.

        Raises:
            ValueError: the message says which setting conflicts with the budget.
        """

    def on_prefill(self, view: PrefillView) -> list[KVAction]:
        return []

    def on_decode(self, view: DecodeView) -> list[KVAction]:
        return []

    def hold_budget(self, seq: Sequence, kv: KVCache, budget: float) -> None:
        """After a step's actions: bring ``seq`` within ``budget`` x full-KV bytes the policy's way
        (PASK demotes its table state). The engine's own fallback runs after it."""


class FullKV(KVPolicy):
    """Keep every entry at HIGH precision (the reference policy)."""
    name = "full"

    def check(self, num_prompt_tokens, budget, kv):
        if budget < 1.0:
            raise ValueError(f"policy 'full' keeps all KV and cannot meet a budget of {budget}")
