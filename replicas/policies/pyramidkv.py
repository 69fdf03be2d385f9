"""PyramidKV: SnapKV scores under layer budgets that decrease with depth.

Source: Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
Funneling" (arXiv:2406.02069), section 3.2: every layer keeps the observation window, and the
capacity above it forms an arithmetic sequence from ``2 * C - C / beta`` at the first layer to
``C / beta`` at the last (``C`` the mean capacity above the window, ``beta`` = 20 in the paper),
same total as a uniform split.
"""

from __future__ import annotations

from dataclasses import dataclass

from replicas.policies.base import split_evenly
from replicas.policies.snapkv import SnapKVPolicy


@dataclass
class PyramidKVPolicy(SnapKVPolicy):
    """Attributes (plus SnapKV's): beta: ratio of the mean to the last layer's capacity."""
    beta: float = 20.0
    name = "pyramidkv"

    def __post_init__(self):
        super().__post_init__()
        if self.beta < 1:
            raise ValueError(f"beta must be >= 1, got {self.beta}")

    def layer_split(self, num_layers, units, unit_tokens):
        block = unit_tokens
        mean = units * block / num_layers
        if num_layers == 1 or mean <= self.window_size:
            return split_evenly(units, num_layers)
        extra = mean - self.window_size
        low = extra / self.beta
        step = (2 * extra - 2 * low) / (num_layers - 1)
        shares = [(self.window_size + 2 * extra - low - i * step) / block for i in range(num_layers)]
        out = [int(s) for s in shares]
        # Hand out the units lost to rounding, largest remainder first, so the total is exact.
        order = sorted(range(num_layers), key=lambda i: shares[i] - out[i], reverse=True)
        for i in order[: units - sum(out)]:
            out[i] += 1
        return out
