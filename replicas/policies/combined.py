"""CompilerKV for the prompt, PASK for generated tokens, under one total budget (design 5 + 4).

The serving default. After prefill, CompilerKV keeps each layer's ``floor(budget x prompt)``
best prompt tokens (page-aligned, so the prompt alone meets the budget); PASK's decode table then
stores each generated token per layer group. When the sequence would exceed the budget, decode
cells are demoted and prompt pages released together (``hold_budget``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replicas.kv_cache import KVCache, Precision
from replicas.policies.base import total_pages
from replicas.policies.compilerkv import CompilerKVPolicy
from replicas.policies.pask import PASKPolicy
from replicas.policy import DecodeView, KVAction, KVPolicy, PrefillView


@dataclass
class CompilerKVPASKPolicy(KVPolicy):
    """Attributes:
        pask_table: PASK table folder (None: the one shipped for the model).
        compilerkv_tables: CompilerKV table folder (None: the one shipped for the model, when there
            is one; else W = 1, T = 1).
        window: CompilerKV's observation window.
    """
    pask_table: str | None = None
    compilerkv_tables: str | None = None
    window: int = 32
    name = "compilerkv+pask"
    table_kinds = ("pask",)
    needs_tags = True
    wants_window_ppl = True
    precisions = (Precision.HIGH, Precision.INT8, Precision.INT4)

    def __post_init__(self):
        self.prompt = CompilerKVPolicy(window=self.window, tables=self.compilerkv_tables)
        self.decode = PASKPolicy(self.pask_table, prompt_side=False)
        self.observation_window = self.window

    def bind_model(self, model_dir) -> None:
        self.decode.bind_model(model_dir)
        self.prompt.bind_model(model_dir)

    @property
    def floor_cost(self) -> float:
        return self.decode.floor_cost

    def swap_table(self, folder, model_dir) -> None:
        self.decode.swap_table(folder, model_dir)

    def check(self, num_prompt_tokens: int, budget: float, kv: KVCache) -> None:
        self.decode.check(num_prompt_tokens, budget, kv)
        cfg = kv.cfg
        if total_pages(budget, cfg.num_layers, num_prompt_tokens, cfg.block_size) < cfg.num_layers:
            raise ValueError(f"a budget of {budget} leaves less than one page per layer for a "
                             f"{num_prompt_tokens}-token prompt")

    def check_prompt(self, labels, budget, kv) -> None:
        pass

    def prompt_floor(self, labels, kv) -> float:
        return 0.0

    def on_prefill(self, view: PrefillView) -> list[KVAction]:
        cfg = view.kv.cfg
        pages = total_pages(view.budget, cfg.num_layers, view.num_prefilled, cfg.block_size) // cfg.num_layers
        actions = self.prompt.prefill_actions(view, max(1, pages * cfg.block_size))
        return actions + self.decode.on_prefill(view)

    def on_decode(self, view: DecodeView) -> list[KVAction]:
        return self.decode.on_decode(view)

    def decode_targets(self, seqs, kv: KVCache):
        return self.decode.decode_targets(seqs, kv)

    def hold_budget(self, seq, kv: KVCache, budget: float) -> None:
        """Until the sequence holds at most ``budget`` x full-KV bytes: while PASK's decode state has a
        higher expected KV fraction than the share of the prompt CompilerKV still keeps, PASK demotes
        a decode cell; otherwise the prompt gives back its lowest-scoring CompilerKV tokens (outside
        the window), one page from the layer holding the most. Both sides descend together: the
        prompt is sized to the budget at prefill, so demoting only the decode side (as before)
        drained the decode state to its floors within a 24-token answer (regression test)."""
        if budget >= 1.0 or "pask_k" not in seq.policy_state:
            return
        allowed = budget * kv.full_kv_bytes(seq.num_tokens)
        scores = seq.policy_state.get("ckv_scores", {})
        prompt_len = len(seq.prompt_token_ids)
        while kv.sequence_bytes(seq.request_id) > allowed + 1e-6:
            # One pass over the layers: the prompt's kept share, and the layer with most droppable tokens.
            kept_prompt, best = 0, None
            for layer in range(kv.cfg.num_layers):
                kept = kv.kept_positions(seq.request_id, layer)
                kept_prompt += int((kept < prompt_len).sum())
                sc = scores.get(layer)
                if sc is not None:
                    cand = kept[kept < sc.shape[0]]
                    droppable = cand[~torch.isinf(sc[cand])]
                    if droppable.numel() and (best is None or droppable.numel() > best[1].numel()):
                        best = (layer, droppable)
            prompt_share = kept_prompt / max(1, prompt_len * kv.cfg.num_layers)
            if self.decode.decode_fraction(seq) >= prompt_share and self.decode.demote_once(seq, kv, "decode"):
                continue
            if best is None:
                if not self.decode.demote_once(seq, kv, "decode"):
                    return
                continue
            layer, kept = best
            order = torch.sort(scores[layer][kept], stable=True).indices
            kv.set_precision(seq.request_id, layer, kept[order[: kv.cfg.block_size]], Precision.RELEASED)
