"""PyramidKV: SnapKV scores under layer budgets that decrease with depth.

Source: Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
Funneling" (arXiv:2406.02069), section 3.2: every layer keeps the observation window, and the
capacity above it forms an arithmetic sequence from ``2 * C - C / beta`` at the first layer to
``C / beta`` at the last (``C`` the mean capacity above the window, ``beta`` = 20 in the paper),
same total as a uniform split.

The paper compresses the prompt once and then keeps every generated token in every layer. Under a
total budget (``kv_budget`` < 1) the pyramid is drawn over what is left once each layer holds the
window and the generated tokens, so that generated tokens, like the paper's, sit in every layer on
top of the layer's pyramid share of the prompt. (Drawn over the whole budget instead, the last
layers' quota, ``window + extra / beta``, filled with generated tokens after about a window's
worth of them and the deep layers lost the whole prompt: measured in
``docs/results/kvpress_crosscheck_pyramidkv.md``.)

NVIDIA kvpress's ``PyramidKVPress`` (0.5.5) draws the same arithmetic sequence over the kept tokens
window included and falls back to a uniform (SnapKV) split when the last layer's share would be
under the window (for ``B < beta * window``, 1,280 tokens at the defaults, unless its clamp of the
first layer to ``n - window`` lifts the last); this class
follows the paper and the authors' code (KVCache-Factory), which have no such fallback.
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

    def layer_split(self, num_layers, units, unit_tokens, generated=0):
        """Split ``units`` of ``unit_tokens`` tokens over layers: every layer gets the window and
        the ``generated`` tokens alike, the rest is the pyramid (uniform when nothing is left)."""
        block = unit_tokens
        mean = units * block / num_layers
        common = self.window_size + generated
        if num_layers == 1 or mean <= common:
            return split_evenly(units, num_layers)
        extra = mean - common
        low = extra / self.beta
        step = (2 * extra - 2 * low) / (num_layers - 1)
        shares = [(common + 2 * extra - low - i * step) / block for i in range(num_layers)]
        out = [int(s) for s in shares]
        # Hand out the units lost to rounding, largest remainder first, so the total is exact.
        order = sorted(range(num_layers), key=lambda i: shares[i] - out[i], reverse=True)
        for i in order[: units - sum(out)]:
            out[i] += 1
        return out
