"""Random eviction: keep a uniformly random subset of each layer's tokens (a floor)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from replicas.policies.base import ScoredPolicy


@dataclass
class RandomPolicy(ScoredPolicy):
    """Attributes:
        seed: combined with the request id, so a request's choices are reproducible.
    """
    seed: int = 0
    name = "random"

    def _gen(self, seq) -> torch.Generator:
        if "generator" not in seq.policy_state:
            seq.policy_state["generator"] = torch.Generator().manual_seed(
                self.seed * 1_000_003 + zlib.crc32(seq.request_id.encode()))
        return seq.policy_state["generator"]

    def prefill_scores(self, view, layer, positions):
        return torch.rand(positions.shape[0], generator=self._gen(view.seq))

    def decode_scores(self, seqs, positions, num_layers):
        return torch.stack([torch.rand(num_layers, generator=self._gen(s)) for s in seqs])
