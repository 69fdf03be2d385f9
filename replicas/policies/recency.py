"""Recency only: keep the most recent tokens of each layer (a floor for the other methods)."""

from __future__ import annotations

from dataclasses import dataclass

from replicas.policies.base import ScoredPolicy


@dataclass
class RecencyPolicy(ScoredPolicy):
    name = "recency"
    static_scores = True   # prompt scores fixed at prefill; a generated token's grow with its position
    compresses_chunks = True   # scores depend on positions only

    def prefill_scores(self, view, layer, positions):
        return positions.float()
