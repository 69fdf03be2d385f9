"""PASK online policy: per-token table lookup from structural tags, under a budget state.

Source: PASK, parser-aware structural KV persistence (design section 4.5): each generated token's
structural bucket (``replicas.tagger``) and each layer group index a frozen, offline-calibrated
table of actions (RELEASE < INT4 < INT8 < HIGH). No attention statistics at run time.

Budget state (constant size): the calibrated candidate family is nested: the floors, then a
sequence of adjacent upgrades ``(bucket, group)`` one precision step each, in calibrated order. The
state is how many upgrades are applied; a lower replica budget applies fewer (demoting above-floor
cells in reverse upgrade order), a higher one more. Floors are never crossed.

Prompt tokens are kept at HIGH here: the prompt side is CompilerKV's (or the PASK prompt-side
companion's) job, composed by the engine's combined policy.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from replicas.kv_cache import Precision
from replicas.policy import DecodeView, KVAction, KVPolicy, PrefillView
from replicas.tagger import NUM_BUCKETS


@dataclass
class PASKTable:
    """A frozen PASK table (the tensors of a ``calibration.artifacts.TableArtifact`` of kind "pask").

    Attributes:
        floors: ``[num_buckets, G]`` int, the cheapest precision each cell tolerates (Precision values).
        upgrades: ``[U, 2]`` int, (bucket, group) of each adjacent upgrade, in calibrated order.
        upgrade_costs: ``[U]`` float, cumulative expected KV fraction after each upgrade (rising).
        floor_cost: expected KV fraction with the floors alone.
        layer_groups: G contiguous ``(start, end)`` layer ranges covering all layers.
    """
    floors: torch.Tensor
    upgrades: torch.Tensor
    upgrade_costs: torch.Tensor
    floor_cost: float
    layer_groups: list[tuple[int, int]]

    def __post_init__(self):
        g = len(self.layer_groups)
        if self.floors.shape != (NUM_BUCKETS, g):
            raise ValueError(f"floors must be [{NUM_BUCKETS}, {g}], got {tuple(self.floors.shape)}")
        if self.upgrades.dim() != 2 or self.upgrades.shape[1] != 2 or len(self.upgrade_costs) != len(self.upgrades):
            raise ValueError("upgrades must be [U, 2] with one cumulative cost per upgrade")
        if any(b <= a for a, b in self.layer_groups) or any(
                self.layer_groups[i][1] != self.layer_groups[i + 1][0] for i in range(g - 1)):
            raise ValueError(f"layer groups must be contiguous, non-empty ranges: {self.layer_groups}")

    def actions_at(self, num_upgrades: int) -> torch.Tensor:
        """The ``[num_buckets, G]`` action table with the first ``num_upgrades`` upgrades applied."""
        table = self.floors.clone()
        for bucket, group in self.upgrades[:num_upgrades].tolist():
            table[bucket, group] = min(int(table[bucket, group]) + 1, int(Precision.HIGH))
        return table

    def upgrades_for_budget(self, budget: float) -> int:
        """Most upgrades whose expected KV fraction stays within ``budget`` (0 = floors only)."""
        return bisect.bisect_right(self.upgrade_costs.tolist(), budget)


@dataclass
class PASKPolicy(KVPolicy):
    """Attributes:
        table: the frozen table (a calibrated one ships with the embedded model).
    """
    table: PASKTable | None = None
    name = "pask"
    needs_tags = True
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.table is None:
            raise ValueError("PASK needs a calibrated table (python -m calibration pask --model PATH --out DIR)")

    def state_for(self, budget: float) -> torch.Tensor:
        """The action table for a budget (cached: one per distinct budget)."""
        if budget not in self._cache:
            self._cache[budget] = self.table.actions_at(self.table.upgrades_for_budget(budget))
        return self._cache[budget]

    def on_prefill(self, view: PrefillView) -> list[KVAction]:
        return []

    def on_decode(self, view: DecodeView) -> list[KVAction]:
        bucket = view.seq.policy_state.get("tags", {}).get(view.position)
        if bucket is None:
            return []
        actions = self.state_for(view.budget)[bucket]
        out = []
        for group, (start, end) in enumerate(self.table.layer_groups):
            precision = Precision(int(actions[group]))
            if precision != Precision.HIGH:
                out.extend(KVAction(layer, (view.position,), precision) for layer in range(start, end))
        return out
