"""The KV policy interface: a policy decides what the KV cache keeps; the engine carries it out.

Modelled on NVIDIA kvpress: one small class per method, configured by dataclass fields. A policy
declares what it needs in :attr:`KVPolicy.spec` (the engine never probes for attributes) and decides
at three points:

- :meth:`KVPolicy.on_prefill`, after a sequence's prompt is in the cache: which prompt tokens each
  layer keeps, and at which precision (:class:`KVAction` s, applied with ``KVCache.set_precision``);
- :meth:`KVPolicy.decode_targets`, before a decode step, for the whole batch: the precision each
  new token is *stored* at in every layer (``[B, L]``; PASK looks it up from the token's parser
  bucket), so nothing is written at HIGH to be demoted a step later;
- :meth:`KVPolicy.decode_evictions`, after the step's forward, for the whole batch: which kept
  entries to release (scoring policies: the lowest score of each layer over its quota, one
  ``argmin`` over ``(pairs, positions)``).

The budget guarantee (bytes held <= budget x full-KV bytes after every step) is the engine's:
it checks the batch in one comparison and calls :meth:`KVPolicy.hold_budget` only for a sequence
that is over.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replicas.kv_cache import KVCache, Precision
from replicas.sequence import Sequence


@dataclass(frozen=True)
class PolicySpec:
    """What a policy needs from the engine, declared once.

    Attributes:
        needs_tags: structural tags of generated tokens and labels of prompt tokens (PASK).
        observation_window: prompt queries to record per layer for ``on_prefill`` (last w tokens).
        wants_window_ppl: the perplexity of those window tokens (CompilerKV's risk gate).
        record_decode_queries: pass each decode step's queries to ``decode_evictions`` (H2O).
        prompt_only: compresses the prompt to a token count; held at budget 1.0.
        table_kinds: calibrated tables the cluster registry may swap in (``LLMEngine.load_table``).
        precisions: KV pools the policy stores into (HIGH always).
        compresses_chunks: a chunked prefill holds at most the budget plus one chunk, because the
            policy stores each chunk at its targets (PASK) or compresses the prompt after each
            chunk (:meth:`KVPolicy.on_prefill_chunk`) to the entries it would keep at the
            prompt's end (scores that depend on positions only); admission then counts one chunk,
            not the whole prompt.
        forced_chunks: generated tokens may reach the cache as a chunk of several tokens in one
            forward (jump-forward decoding, ``replicas/jump_forward.py``): the policy's decisions
            for a generated token need nothing from a decode step of its own (full KV; PASK,
            whose targets come from each token's tag). Policies that score or evict per decode
            step (StreamingLLM, H2O, SnapKV, ...) leave it False and decode forced tokens one
            step each.
        shares_prompt_pages: prompt entries stay where prefill wrote them (HIGH, slot order, never
            released or demoted), so a prefix cache shares its pages in place (full KV). Any other
            policy gets a cached prefix as a full-precision *shadow* that its prompt's chunks
            attend to, and its own copy of the prefix at its targets (``replicas.prefix_cache``).
    """
    needs_tags: bool = False
    observation_window: int = 0
    wants_window_ppl: bool = False
    record_decode_queries: bool = False
    prompt_only: bool = False
    table_kinds: tuple[str, ...] = ()
    precisions: tuple[Precision, ...] = (Precision.HIGH,)
    compresses_chunks: bool = False
    forced_chunks: bool = False
    shares_prompt_pages: bool = False


@dataclass(frozen=True)
class Evictions:
    """Releases decided for a decode batch: one position per distinct (row, layer) pair in
    ``rows, layers, positions`` (``[n]`` int64 each; applied by ``KVCache.release_one``), plus
    rare per-sequence actions (several releases in one layer, e.g. after the budget fell)."""
    rows: torch.Tensor
    layers: torch.Tensor
    positions: torch.Tensor
    actions: tuple[tuple[Sequence, KVAction], ...] = ()

    @property
    def is_empty(self) -> bool:
        return self.rows.numel() == 0 and not self.actions


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
    """Base class. The class attributes below are the defaults of :attr:`spec`."""
    name = "base"
    observation_window = 0
    record_decode_queries = False
    needs_tags = False
    wants_window_ppl = False
    prompt_only = False
    table_kinds: tuple[str, ...] = ()
    precisions: tuple[Precision, ...] = (Precision.HIGH,)
    compresses_chunks = False
    forced_chunks = False
    shares_prompt_pages = False
    floor_cost = 0.0   # expected KV fraction at the policy's floors (0: no floors)

    @property
    def spec(self) -> PolicySpec:
        """What the policy needs (read by the engine once per request or step)."""
        return PolicySpec(self.needs_tags, self.observation_window, self.wants_window_ppl,
                          self.record_decode_queries, bool(self.prompt_only), tuple(self.table_kinds),
                          tuple(self.precisions), bool(self.compresses_chunks),
                          bool(self.forced_chunks), bool(self.shares_prompt_pages))

    def bind_model(self, model_dir) -> None:
        """Load what the policy needs for the served model (tables); default: nothing."""

    def check_prompt(self, labels: list[int], budget: float, kv: KVCache) -> None:
        """Refuse a prompt (by its labels) whose floors exceed ``budget`` (policies with tags)."""

    def prompt_floor(self, labels: list[int], kv: KVCache) -> float:
        """KV fraction of this prompt at the policy's floors (0 without floors)."""
        return 0.0

    def swap_table(self, folder, model_dir) -> None:
        raise ValueError(f"policy {self.name!r} has no swappable table")

    def check(self, num_prompt_tokens: int, budget: float, kv: KVCache) -> None:
        """Refuse, before any work, a request whose budget this policy cannot meet.

        Raises:
            ValueError: the message says which setting conflicts with the budget.
        """

    def on_prefill(self, view: PrefillView) -> list[KVAction]:
        return []

    def on_prefill_chunk(self, view: PrefillView) -> list[KVAction]:
        """After a prompt chunk that is not the prompt's last (``view.num_prefilled`` tokens in the
        cache), for a policy whose spec sets ``compresses_chunks``: releases that its
        :meth:`on_prefill` at the prompt's end would make anyway."""
        return []

    def on_decode(self, view: DecodeView) -> list[KVAction]:
        """One sequence's decode decisions after its new token is stored (tests and tools; the
        engine calls the batched :meth:`decode_targets` and :meth:`decode_evictions`)."""
        return []

    def prefill_targets(self, seq: Sequence, kv: KVCache) -> torch.Tensor | None:
        """``[n, L]`` int64 Precision each prefilled token is stored at per layer, when the policy
        knows it before the forward (PASK's prompt labels), or None: all HIGH, then
        :meth:`on_prefill` decides from what the forward saw."""
        return None

    def decode_targets(self, seqs: list[Sequence], kv: KVCache,
                       lengths: list[int] | None = None) -> torch.Tensor | None:
        """``[B, L]`` int64 Precision each new token of the batch is stored at per layer (the token
        each sequence feeds this step, at position ``num_tokens - 1``; ``lengths``: each
        sequence's ``num_tokens``, computed from ``seqs`` when None), or None: all HIGH."""
        return None

    def decode_evictions(self, seqs: list[Sequence], kv: KVCache, rows: torch.Tensor,
                         queries: dict[int, torch.Tensor], positions: torch.Tensor | None = None) -> Evictions | None:
        """Releases after a decode step (``rows [B]``: the batch's cache rows; ``queries``: layer ->
        ``[B, Hq, D]`` when the spec records them; ``positions [B]`` int64: each new token's
        position, ``num_tokens - 1``, computed from ``seqs`` when None). None: nothing to release."""
        return None

    def hold_budget(self, seq: Sequence, kv: KVCache, budget: float) -> None:
        """After a step's actions: bring ``seq`` within ``budget`` x full-KV bytes the policy's way
        (PASK demotes its table state). The engine's own fallback runs after it."""


class FullKV(KVPolicy):
    """Keep every entry at HIGH precision (the reference policy)."""
    name = "full"
    forced_chunks = True
    shares_prompt_pages = True

    def check(self, num_prompt_tokens, budget, kv):
        if budget < 1.0:
            raise ValueError(f"policy 'full' keeps all KV and cannot meet a budget of {budget}")
