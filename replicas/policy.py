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
    """
    seq: Sequence
    kv: KVCache
    num_prefilled: int
    queries: dict[int, torch.Tensor]
    budget: float


@dataclass
class DecodeView:
    """What a policy sees after a decode step of one sequence (``position`` is the new token's)."""
    seq: Sequence
    kv: KVCache
    position: int
    budget: float


class KVPolicy:
    """Base class. ``observation_window``: prompt queries to record per layer for ``on_prefill``."""
    name = "base"
    observation_window = 0

    def on_prefill(self, view: PrefillView) -> list[KVAction]:
        return []

    def on_decode(self, view: DecodeView) -> list[KVAction]:
        return []


class FullKV(KVPolicy):
    """Keep every entry at HIGH precision (the reference policy)."""
    name = "full"


POLICIES: dict[str, type[KVPolicy]] = {"full": FullKV}


def make_policy(name: str, **kwargs) -> KVPolicy:
    """Instantiate a registered policy.

    Raises:
        ValueError: an unknown policy name (the message lists the known ones).
    """
    if name not in POLICIES:
        raise ValueError(f"unknown KV policy {name!r}; choose from {', '.join(sorted(POLICIES))}")
    return POLICIES[name](**kwargs)
