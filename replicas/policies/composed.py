"""A prompt compressor and a decode policy under one total budget.

The composition of NVIDIA kvpress's ``PrefillDecodingPress(prefilling_press, decoding_press)``:
one policy decides what the prompt keeps when it is in the cache, another how each generated
token is stored, and the pair answers to one total budget (bytes held <= budget x full-KV bytes,
prompt and generated tokens together). ``compilerkv+pask`` (CompilerKV for the prompt, PASK for
generated tokens; design sections 4.5 and 5) is this composition; any prompt compressor and any
decode policy with the hooks below compose the same way.

What each side must provide:

- the prompt side: ``prefill_actions(view, budget_tokens)`` (keep at
  most ``budget_tokens`` per layer) and ``prompt_pages(seq, kv)``, made once per budget event:
  an object with ``share`` (the share of prompt entries it still keeps) and ``release_page()``
  (give back one page of its lowest-scoring prompt entries; False when nothing is left to give),
  as ``replicas.policies.compilerkv.PromptPages``;
- the decode side: ``decode_targets`` / ``decode_evictions`` /
  ``on_prefill`` as any policy, ``decode_fraction(seq)`` (expected KV fraction of its current
  state) ``demote_once(seq, kv, "decode")`` (one step down; False at its floors) and ``tracks(seq)``
  (its state for the sequence has started).
"""

from __future__ import annotations

from dataclasses import dataclass
from replicas.kv_cache import KVCache
from replicas.policies.base import total_pages
from replicas.policies.compilerkv import CompilerKVPolicy
from replicas.policies.pask import PASKPolicy
from replicas.policy import DecodeView, KVAction, KVPolicy, PrefillView
from replicas.sequence import Sequence


class PrefillDecodePolicy(KVPolicy):
    """``prefill`` compresses the prompt to the budget's share of pages when the prompt is in the
    cache; ``decode`` stores (and demotes) generated tokens; :meth:`hold_budget` makes both sides
    give back together when the sequence is over its total budget.

    The spec is the union of the two sides': the prompt side's observation window and window
    perplexity, the decode side's tags, decode queries and tables, both sides' precision pools.
    The prompt is prefilled at HIGH (no ``prefill_targets``): the prompt side decides from what
    the forward saw.
    """

    def __init__(self, prefill: KVPolicy, decode: KVPolicy, name: str | None = None):
        for hook in ("prefill_actions", "prompt_pages"):
            if not callable(getattr(prefill, hook, None)):
                raise TypeError(f"{type(prefill).__name__} is not a prompt compressor: it has no {hook}()")
        for hook in ("tracks", "decode_fraction", "demote_once"):
            if not callable(getattr(decode, hook, None)):
                raise TypeError(f"{type(decode).__name__} is not a decode compressor: it has no {hook}()")
        self.prefill, self.decode = prefill, decode
        self.name = name or f"{prefill.name}+{decode.name}"
        p, d = prefill.spec, decode.spec
        self.needs_tags = p.needs_tags or d.needs_tags
        self.observation_window = p.observation_window
        self.wants_window_ppl = p.wants_window_ppl
        self.record_decode_queries = d.record_decode_queries
        self.prompt_only = False
        self.table_kinds = tuple(dict.fromkeys(d.table_kinds + p.table_kinds))
        self.precisions = tuple(sorted(set(p.precisions) | set(d.precisions), reverse=True))
        self.forced_chunks = d.forced_chunks   # generated tokens are the decode side's

    def bind_model(self, model_dir) -> None:
        self.decode.bind_model(model_dir)
        self.prefill.bind_model(model_dir)

    @property
    def floor_cost(self) -> float:
        return self.decode.floor_cost

    def swap_table(self, folder, model_dir) -> None:
        """Swap the table of the side that has swappable tables (the decode side's first)."""
        for side in (self.decode, self.prefill):
            if side.spec.table_kinds:
                return side.swap_table(folder, model_dir)
        raise ValueError(f"policy {self.name!r} has no swappable table")

    def check(self, num_prompt_tokens: int, budget: float, kv: KVCache) -> None:
        self.decode.check(num_prompt_tokens, budget, kv)
        cfg = kv.cfg
        if total_pages(budget, cfg.num_layers, num_prompt_tokens, cfg.block_size) < cfg.num_layers:
            raise ValueError(f"a budget of {budget} leaves less than one page per layer for a "
                             f"{num_prompt_tokens}-token prompt")

    def check_prompt(self, labels, budget, kv) -> None:
        self.decode.check_prompt(labels, budget, kv)

    def prompt_floor(self, labels, kv) -> float:
        return self.decode.prompt_floor(labels, kv)

    def on_prefill(self, view: PrefillView) -> list[KVAction]:
        """The prompt side keeps ``floor(budget x prompt)`` tokens per layer (page-aligned, so the
        prompt alone meets the budget), then the decode side starts its state."""
        cfg = view.kv.cfg
        pages = total_pages(view.budget, cfg.num_layers, view.num_prefilled, cfg.block_size) // cfg.num_layers
        actions = self.prefill.prefill_actions(view, max(1, pages * cfg.block_size))
        return actions + self.decode.on_prefill(view)

    def on_decode(self, view: DecodeView) -> list[KVAction]:
        return self.decode.on_decode(view)

    def decode_targets(self, seqs, kv: KVCache, lengths=None):
        return self.decode.decode_targets(seqs, kv, lengths)

    def decode_evictions(self, seqs, kv, rows, queries, positions=None):
        return self.decode.decode_evictions(seqs, kv, rows, queries, positions)

    def hold_budget(self, seq: Sequence, kv: KVCache, budget: float) -> None:
        """Until the sequence holds at most ``budget`` x full-KV bytes: while the decode side's state
        has a higher expected KV fraction than the share of the prompt the prompt side still keeps,
        the decode side demotes one step; otherwise the prompt side gives back one page. Both sides
        descend together: the prompt is sized to the budget at prefill, so demoting only the decode
        side drained it to its floors within a 24-token answer (regression test in
        ``tests/replicas/test_pask_policy.py``)."""
        if budget >= 1.0 or not self.decode.tracks(seq):
            return
        allowed = budget * kv.full_kv_bytes(seq.num_tokens)
        prompt = self.prefill.prompt_pages(seq, kv)
        fraction = self.decode.decode_fraction(seq)   # (changes only when the decode side demotes)
        while kv.sequence_bytes(seq.request_id) > allowed + 1e-6:
            if fraction >= prompt.share and self.decode.demote_once(seq, kv, "decode"):
                fraction = self.decode.decode_fraction(seq)
                continue
            if prompt.release_page():
                continue
            if not self.decode.demote_once(seq, kv, "decode"):
                return


@dataclass
class CompilerKVPASKPolicy(PrefillDecodePolicy):
    """CompilerKV for the prompt, PASK for generated tokens (the serving default).

    Attributes:
        pask_table: PASK table folder (None: the one shipped for the model).
        compilerkv_tables: CompilerKV table folder (None: the one shipped for the model, when there
            is one; else W = 1, T = 1).
        window: CompilerKV's observation window.
    """
    pask_table: str | None = None
    compilerkv_tables: str | None = None
    window: int = 32
    name = "compilerkv+pask"

    def __post_init__(self):
        super().__init__(CompilerKVPolicy(window=self.window, tables=self.compilerkv_tables),
                         PASKPolicy(self.pask_table, prompt_side=False), name="compilerkv+pask")
