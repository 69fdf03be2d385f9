"""PASK online policy: per-token table lookup from structural tags, under a budget state.

Source: PASK, parser-aware structural KV persistence (design section 4.5). Each generated token's
structural bucket (``replicas.tagger``) and each layer group index a frozen, offline-calibrated
action table (RELEASE < INT4 < INT8 < HIGH; INT4 is our extension beyond the paper's three levels);
the prompt-side companion does the same for prompt tokens with input-derived labels
(``replicas.prompt_labels``). No attention statistics at run time.

Budget state (constant size per sequence: two integers). Each side's calibrated candidate family
is nested: the floors, then a sequence of adjacent upgrades ``(bucket, group)``, one precision step
each, in calibrated order. The state ``(k_prompt, k_decode)`` says how many upgrades of each family
are applied. After prefill ``k_prompt`` is the largest state whose expected bytes fit the budget;
after every step, while the sequence holds more than ``budget x full-KV bytes``, the last applied
decode upgrade is undone (its cell's existing entries demoted one level), then the prompt's. When
the budget rises, later tokens get the larger state. Floors are never crossed: a request whose
prompt cannot meet its budget at the floors is refused before it runs (:meth:`PASKPolicy.check_prompt`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from replicas.kv_cache import KVCache, Precision
from replicas.policy import DecodeView, KVAction, KVPolicy, PrefillView
from replicas.prompt_labels import NUM_PROMPT_BUCKETS
from replicas.tagger import NUM_BUCKETS


@dataclass
class SideTable:
    """One side's nested candidate family.

    Attributes:
        floors: ``[num_buckets, G]`` int, the cheapest precision each cell tolerates (Precision values).
        upgrades: ``[U, 2]`` int, (bucket, group) of each adjacent upgrade, in calibrated order.
        upgrade_costs: ``[U + 1]`` float, expected KV fraction of this side's tokens with the first
            ``k`` upgrades applied (``k = 0``: floors only), from the calibration data's bucket mix.
    """
    floors: torch.Tensor
    upgrades: torch.Tensor
    upgrade_costs: torch.Tensor

    def __post_init__(self):
        self.floors = self.floors.to(torch.int64)
        self.upgrades = self.upgrades.to(torch.int64).reshape(-1, 2)
        self.upgrade_costs = self.upgrade_costs.to(torch.float64)
        if len(self.upgrade_costs) != len(self.upgrades) + 1:
            raise ValueError(f"upgrade_costs must have U + 1 = {len(self.upgrades) + 1} entries, "
                             f"got {len(self.upgrade_costs)}")
        if ((self.floors < int(Precision.RELEASED)) | (self.floors > int(Precision.HIGH))).any():
            raise ValueError("floors must hold Precision values 0..3")
        table, self._states = self.floors.clone(), [self.floors.clone()]
        for i, (bucket, group) in enumerate(self.upgrades.tolist()):
            if not (0 <= bucket < table.shape[0] and 0 <= group < table.shape[1]):
                raise ValueError(f"upgrade {i} names cell ({bucket}, {group}) outside the table")
            if table[bucket, group] >= int(Precision.HIGH):
                raise ValueError(f"upgrade {i} ({bucket}, {group}) lifts a cell that is already HIGH")
            table[bucket, group] += 1
            self._states.append(table.clone())

    @property
    def num_upgrades(self) -> int:
        return len(self.upgrades)

    def actions_at(self, k: int) -> torch.Tensor:
        """The ``[num_buckets, G]`` action table with the first ``k`` upgrades applied."""
        return self._states[k]

    def state_for(self, budget: float) -> int:
        """Most upgrades whose expected KV fraction stays within ``budget`` (0 = floors only)."""
        return max(0, int((self.upgrade_costs <= budget + 1e-9).sum()) - 1)


@dataclass
class PASKTable:
    """A frozen PASK table: the decode side, the prompt side and the layer groups.

    Attributes:
        decode: family over the generated tokens' structural buckets (``replicas.tagger.BUCKETS``).
        prompt: family over the prompt tokens' labels (``replicas.prompt_labels.PROMPT_BUCKETS``).
        layer_groups: G contiguous ``(start, end)`` layer ranges covering all layers.
    """
    decode: SideTable
    prompt: SideTable
    layer_groups: list[tuple[int, int]]

    def __post_init__(self):
        g = len(self.layer_groups)
        if g < 1 or self.layer_groups[0][0] != 0 or any(b <= a for a, b in self.layer_groups) or any(
                self.layer_groups[i][1] != self.layer_groups[i + 1][0] for i in range(g - 1)):
            raise ValueError(f"layer groups must be contiguous, non-empty ranges from layer 0: {self.layer_groups}")
        for side, n in ((self.decode, NUM_BUCKETS), (self.prompt, NUM_PROMPT_BUCKETS)):
            if tuple(side.floors.shape) != (n, g):
                raise ValueError(f"floors must be [{n}, {g}], got {tuple(side.floors.shape)}")

    @property
    def num_layers(self) -> int:
        return self.layer_groups[-1][1]

    def group_of_layer(self) -> list[int]:
        return [g for g, (a, b) in enumerate(self.layer_groups) for _ in range(a, b)]

    # ------------------------------------------------------------------ artifacts
    def to_tables(self) -> dict[str, torch.Tensor]:
        return {"decode_floors": self.decode.floors.to(torch.int8), "decode_upgrades": self.decode.upgrades,
                "decode_upgrade_costs": self.decode.upgrade_costs, "prompt_floors": self.prompt.floors.to(torch.int8),
                "prompt_upgrades": self.prompt.upgrades, "prompt_upgrade_costs": self.prompt.upgrade_costs,
                "layer_groups": torch.tensor(self.layer_groups, dtype=torch.int64)}

    @classmethod
    def from_tables(cls, t: dict[str, torch.Tensor]) -> "PASKTable":
        return cls(SideTable(t["decode_floors"], t["decode_upgrades"], t["decode_upgrade_costs"]),
                   SideTable(t["prompt_floors"], t["prompt_upgrades"], t["prompt_upgrade_costs"]),
                   [tuple(r) for r in t["layer_groups"].tolist()])

    @classmethod
    def load(cls, folder, model_dir=None) -> "PASKTable":
        """Load a calibrated table artifact (``calibration.artifacts``); validates hash and model.

        Raises:
            calibration.artifacts.ArtifactError: missing, corrupted, or calibrated for another model.
        """
        from calibration.artifacts import load_artifact
        return cls.from_tables(load_artifact(folder, "pask", model_dir).tables)


def level_costs(kv: KVCache) -> torch.Tensor:
    """``[4]`` bytes of one token-layer entry at each Precision, relative to HIGH (page costs)."""
    high = kv.page_cost(Precision.HIGH)
    return torch.tensor([0.0] + [kv.page_cost(p) / high for p in (Precision.INT4, Precision.INT8)] + [1.0],
                        dtype=torch.float64)


def expected_fraction(counts: torch.Tensor, actions: torch.Tensor, group_sizes: torch.Tensor,
                      costs: torch.Tensor) -> float:
    """Expected KV fraction of tokens with bucket ``counts [B]`` under ``actions [B, G]``."""
    total = float(counts.sum())
    if total == 0:
        return 0.0
    per_cell = costs[actions] * group_sizes[None, :].double()                 # [B, G]
    return float((counts.double()[:, None] * per_cell).sum()) / (total * float(group_sizes.sum()))


@dataclass
class PASKPolicy(KVPolicy):
    """Attributes:
        table: a :class:`PASKTable`, or the path of a calibrated artifact folder (None: the table
            shipped with the embedded model).
        prompt_side: apply the prompt-side companion (False when another policy, CompilerKV,
            compresses the prompt).
    """
    table: PASKTable | str | None = None
    prompt_side: bool = True
    name = "pask"
    table_kinds = ("pask",)   # tables the cluster registry may swap in (LLMEngine.load_table)
    needs_tags = True
    precisions = (Precision.HIGH, Precision.INT8, Precision.INT4)
    forced_chunks = True   # a generated token's targets come from its tag (decode_targets)
    _costs: torch.Tensor | None = field(default=None, repr=False)

    @property
    def compresses_chunks(self) -> bool:
        """With its prompt side, each chunk is stored at its table targets (:meth:`prefill_targets`),
        so a chunked prefill holds at most the budget plus one chunk."""
        return self.prompt_side

    _layer_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if isinstance(self.table, PASKTable):
            self._group_sizes = torch.tensor([b - a for a, b in self.table.layer_groups])

    def bind_model(self, model_dir) -> None:
        """Load the table (a path, or the one shipped for ``model_dir``) and check it was calibrated
        for ``model_dir``.

        Raises:
            calibration.artifacts.ArtifactError: no table for this model, or a corrupted one.
        """
        if isinstance(self.table, PASKTable):
            return
        from calibration import shipped_table
        self.table = PASKTable.load(self.table or shipped_table("pask", model_dir), model_dir)
        self._group_sizes = torch.tensor([b - a for a, b in self.table.layer_groups])

    def _check_layers(self, kv: KVCache) -> None:
        if not isinstance(self.table, PASKTable):
            raise ValueError("PASK has no table yet: call bind_model(model_dir) or pass a PASKTable")
        if kv.cfg.num_layers != self.table.num_layers:
            raise ValueError(f"the PASK table covers {self.table.num_layers} layers, the model has {kv.cfg.num_layers}")
        if self._costs is None:
            self._costs = level_costs(kv)

    def check(self, num_prompt_tokens: int, budget: float, kv: KVCache) -> None:
        self._check_layers(kv)

    @property
    def floor_cost(self) -> float:
        """Expected KV fraction with both sides at their floors (calibration data's mix)."""
        if not isinstance(self.table, PASKTable):
            return 0.0
        decode = float(self.table.decode.upgrade_costs[0])
        return max(decode, float(self.table.prompt.upgrade_costs[0])) if self.prompt_side else decode

    def prompt_floor(self, labels: list[int], kv: KVCache) -> float:
        """KV fraction of this prompt with every cell at its floor (0 without the prompt side)."""
        self._check_layers(kv)
        if not self.prompt_side:
            return 0.0
        counts = torch.bincount(torch.tensor(labels, dtype=torch.long), minlength=NUM_PROMPT_BUCKETS)
        return expected_fraction(counts, self.table.prompt.actions_at(0), self._group_sizes, self._costs)

    def swap_table(self, folder, model_dir) -> None:
        """Replace the table by the artifact at ``folder`` (validated first; on any error the
        current table stays). Sequences already running keep the table they started with.

        Raises:
            calibration.artifacts.ArtifactError: a bad artifact; ValueError: another layer count.
        """
        new = PASKTable.load(folder, model_dir)
        if isinstance(self.table, PASKTable) and new.num_layers != self.table.num_layers:
            raise ValueError(f"table covers {new.num_layers} layers, the model has {self.table.num_layers}")
        self.table = new
        self._group_sizes = torch.tensor([b - a for a, b in new.layer_groups])

    def check_prompt(self, labels: list[int], budget: float, kv: KVCache) -> None:
        """Refuse a prompt whose floors alone exceed ``budget``.

        Raises:
            ValueError: the message gives the floors' KV fraction for this prompt.
        """
        self._check_layers(kv)
        if not self.prompt_side:
            return
        counts = torch.bincount(torch.tensor(labels, dtype=torch.long), minlength=NUM_PROMPT_BUCKETS)
        floor = expected_fraction(counts, self.table.prompt.actions_at(0), self._group_sizes, self._costs)
        if floor > budget:
            raise ValueError(f"the PASK floors keep {floor:.4f} of this prompt's KV, above its KV budget of "
                             f"{budget:.4g}; raise kv_budget to at least {math.ceil(floor * 1000) / 1000}")

    # ------------------------------------------------------------------ hooks
    def _start(self, seq, kv: KVCache, budget: float) -> tuple[PASKTable, list[int], dict]:
        """Set a sequence's budget state after prefill: the largest prompt state whose expected
        fraction fits ``budget``, the decode state for ``budget``. Returns (table, labels, tags)."""
        state = seq.policy_state
        self._check_layers(kv)
        labels = state.get("prompt_labels") or [0] * len(seq.prompt_token_ids)
        tags = state.setdefault("tags", {})
        counts = torch.bincount(torch.tensor(labels, dtype=torch.long), minlength=NUM_PROMPT_BUCKETS)
        table = state["pask_table"] = self.table   # a later table swap does not touch this sequence
        prompt = table.prompt
        k = 0
        for cand in range(prompt.num_upgrades, -1, -1):
            if expected_fraction(counts, prompt.actions_at(cand), self._group_sizes, self._costs) <= budget:
                k = cand
                break
        state["pask_k"] = [k if self.prompt_side else 0, table.decode.state_for(budget)]
        state["pask_budget"] = budget
        return table, labels, tags

    def prefill_targets(self, seq, kv: KVCache) -> torch.Tensor | None:
        """``[n, L]`` precision of every prefilled token in every layer, known before the forward
        (input-derived labels, not attention), so the prompt is stored at its table precision
        instead of written at HIGH and demoted: what :meth:`on_prefill` would do, as targets."""
        table, labels, tags = self._start(seq, kv, seq.kv_budget)
        n, prompt_len = seq.num_tokens, len(seq.prompt_token_ids)
        groups = torch.tensor(table.group_of_layer())
        targets = torch.full((n, kv.cfg.num_layers), int(Precision.HIGH), dtype=torch.int64)
        if self.prompt_side:
            per_layer = table.prompt.actions_at(seq.policy_state["pask_k"][0])[:, groups]     # [buckets, L]
            targets[:prompt_len] = per_layer[torch.tensor(labels[:prompt_len], dtype=torch.long)]
        decode = self.layer_actions(table, seq.policy_state["pask_k"][1])
        for p in range(prompt_len, n):   # a recomputed sequence's outputs keep their decode actions
            if p in tags:
                targets[p] = decode[tags[p]]
        seq.policy_state["pask_stored_at_prefill"] = True
        return targets

    def on_prefill(self, view: PrefillView) -> list[KVAction]:
        seq, state = view.seq, view.seq.policy_state
        if state.pop("pask_stored_at_prefill", False):
            return []          # stored at its targets already (prefill_targets)
        table, labels, tags = self._start(seq, view.kv, view.budget)
        prompt_len, k = len(seq.prompt_token_ids), state["pask_k"][0]
        actions = []
        if self.prompt_side:
            actions = self._actions(table, table.prompt.actions_at(k), {p: labels[p] for p in range(prompt_len)})
        # After a preemption the recomputed outputs are prefilled too: they keep their decode actions.
        outputs = {p: tags[p] for p in range(prompt_len, view.num_prefilled) if p in tags}
        actions += self._actions(table, table.decode.actions_at(state["pask_k"][1]), outputs)
        return actions

    def on_decode(self, view: DecodeView) -> list[KVAction]:
        """The new token's demotions, for a token already stored at HIGH (tests and tools): the
        targets of :meth:`decode_targets`, as actions."""
        view.seq.kv_budget = view.budget
        targets = self.decode_targets([view.seq], view.kv)
        if targets is None:
            return []
        return [KVAction(layer, (view.position,), Precision(level))
                for layer, level in enumerate(targets[0].tolist()) if level != int(Precision.HIGH)]

    def layer_actions(self, table: PASKTable, k: int) -> torch.Tensor:
        """``[num_buckets, L]`` int64 decode-side action of every bucket in every layer at state
        ``k`` (the table's ``[num_buckets, G]`` row spread over each group's layers; cached)."""
        return self._decode_stack(table)[k]

    def _decode_stack(self, table: PASKTable) -> torch.Tensor:
        """``[U + 1, num_buckets, L]`` int64: :meth:`layer_actions` at every decode state, built
        once per table, so that a batch's targets are one gather."""
        hit = self._layer_cache.get(id(table))
        if hit is None or hit[0] is not table:
            groups = torch.tensor(table.group_of_layer())
            stack = torch.stack([table.decode.actions_at(k)[:, groups] for k in range(table.decode.num_upgrades + 1)])
            hit = self._layer_cache[id(table)] = (table, stack.contiguous())
        return hit[1]

    def decode_targets(self, seqs, kv: KVCache, lengths: list[int] | None = None) -> torch.Tensor | None:
        """The precision of each sequence's new token per layer, looked up from its parser bucket
        (tagged when it was sampled) at the sequence's decode state: what :meth:`on_decode` would
        demote it to, so the token is stored there directly.

        One gather for the batch: ``(state, bucket)`` rows of the table's stacked actions. The
        per-sequence part is comprehensions over its state (no call per sequence when the engine
        passes ``lengths``): this runs before every decode step."""
        tracked = [(i, seq) for i, seq in enumerate(seqs) if "pask_k" in seq.policy_state]
        if not tracked:
            return None
        # A budget that moved since the last step (the cluster controller, rare): a rise gives
        # later tokens a larger decode state; a fall waits for hold_budget's demotions.
        for _, seq in [t for t in tracked if t[1].kv_budget != t[1].policy_state["pask_budget"]]:
            state = seq.policy_state
            if seq.kv_budget > state["pask_budget"]:
                k = state["pask_k"]
                k[1] = max(k[1], state["pask_table"].decode.state_for(seq.kv_budget))
            state["pask_budget"] = seq.kv_budget
        at = ([(i, seq.policy_state, seq.num_tokens - 1) for i, seq in tracked] if lengths is None
              else [(i, seq.policy_state, lengths[i] - 1) for i, seq in tracked])
        hits = [(i, st["pask_table"], st["pask_k"][1], st["tags"][pos]) for i, st, pos in at if pos in st["tags"]]
        if not hits:
            return None
        out = torch.full((len(seqs), kv.cfg.num_layers), int(Precision.HIGH), dtype=torch.int64)
        first = hits[0][1]
        by_table = ([hits] if not [h for h in hits if h[1] is not first]   # one table: the common case
                    else [[h for h in hits if h[1] is t] for t in {id(h[1]): h[1] for h in hits}.values()])
        for group in by_table:
            rows, _, ks, buckets = zip(*group)
            out[list(rows)] = self._decode_stack(group[0][1])[list(ks), list(buckets)]
        return out

    def hold_budget(self, seq, kv: KVCache, budget: float) -> None:
        """Demote above-floor cells, last upgrade first, until the sequence holds at most ``budget`` x
        full-KV bytes or both sides are at their floors. The engine calls it after applying each
        step's actions.

        The two families descend together: each demotion goes to the side whose current state has
        the higher expected KV fraction (``upgrade_costs``), so neither side is drained to its
        floors to pay for the other. (Draining the decode side first sent every generated token to
        its floor as soon as a long prompt overran the budget at prefill, where the decode side
        holds nothing to free: test accuracy fell from 62 % to 39 % at budget 0.5.)"""
        state = seq.policy_state
        if not self.tracks(seq) or budget >= 1.0:
            return
        allowed = budget * kv.full_kv_bytes(seq.num_tokens)
        while kv.sequence_bytes(seq.request_id) > allowed + 1e-6:
            kp = state["pask_k"][0]
            prompt_level = float(state["pask_table"].prompt.upgrade_costs[kp]) if self.prompt_side else 0.0
            order = ("decode", "prompt") if self.decode_fraction(seq) >= prompt_level else ("prompt", "decode")
            if not (self.demote_once(seq, kv, order[0]) or self.demote_once(seq, kv, order[1])):
                break

    def tracks(self, seq) -> bool:
        """Whether the sequence's budget state has started (set when its prompt is in the cache)."""
        return "pask_k" in seq.policy_state

    def decode_fraction(self, seq) -> float:
        """Expected KV fraction of the decode side's current state (calibration mix); -1 at its floors."""
        state = seq.policy_state
        kd = state["pask_k"][1]
        return float(state["pask_table"].decode.upgrade_costs[kd]) if kd > 0 else -1.0

    def demote_once(self, seq, kv: KVCache, side_name: str) -> bool:
        """Undo the last upgrade of one side (``"decode"`` or ``"prompt"``) on the sequence's existing
        entries and for its later tokens. Returns False when that side is at its floors."""
        state = seq.policy_state
        table, prompt_len = state["pask_table"], seq.num_prompt_tokens
        index = 1 if side_name == "decode" else 0
        if state["pask_k"][index] == 0 or (index == 0 and not self.prompt_side):
            return False
        k = state["pask_k"][index] = state["pask_k"][index] - 1
        side = table.decode if index == 1 else table.prompt
        bucket, group = side.upgrades[k].tolist()
        if index == 1:
            cell = [p for p, b in state["tags"].items() if b == bucket and p >= prompt_len]
        else:
            cell = [p for p, b in enumerate(state.get("prompt_labels") or ()) if b == bucket]
        if cell:   # the whole group in one call (entries already at or below the level stay)
            start, end = table.layer_groups[group]
            kv.set_precision(seq.request_id, range(start, end), torch.tensor(cell, dtype=torch.int64),
                             int(side.actions_at(k)[bucket, group]))
        return True

    @staticmethod
    def _actions(table: PASKTable, actions: torch.Tensor, buckets: dict[int, int]) -> list[KVAction]:
        """Per layer, the positions whose action is below HIGH, grouped by precision."""
        out = []
        by_cell: dict[tuple[int, int], list[int]] = {}
        for pos, bucket in buckets.items():
            for group in range(len(table.layer_groups)):
                level = int(actions[bucket, group])
                if level != int(Precision.HIGH):
                    by_cell.setdefault((group, level), []).append(pos)
        for (group, level), positions in sorted(by_cell.items()):
            start, end = table.layer_groups[group]
            out.extend(KVAction(layer, tuple(positions), Precision(level)) for layer in range(start, end))
        return out
