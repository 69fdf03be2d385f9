"""Continuous batching: admission by KV memory in compressed bytes, chunked prefill, preemption
by recompute.

A step prefills prompts (up to ``max_num_batched_tokens`` tokens in one forward), decodes every
sequence whose prompt is in the cache (one token each), or, with chunked prefill, both at once.
Admission counts *compressed* bytes: a prompt is prefilled (at HIGH, or for PASK at its table's
precisions) and its policy compresses it to at most ``kv_budget`` x full KV when its last chunk is
in, so the step needs the compressed size of every admitted sequence plus the transient (full
minus compressed) of every prompt not yet compressed: the prompts of one prefill forward, and with
chunked prefill those in progress, are at full size together. A policy that compresses the
prompt after each chunk (StreamingLLM, recency: ``SchedulerConfig.compresses_chunks``) holds at
most its compressed size plus one chunk, so with chunked prefill its transient is one chunk. That
is how a third of the KV becomes about three times the batch.

Without chunked prefill (vLLM's default before v1) a step prefills whole prompts, and a waiting
prompt that fits goes before decoding: a 4K prompt stalls every running stream for its whole
prefill. With ``enable_chunked_prefill`` (vLLM v1's scheduling) every step decodes every
prefilled sequence and fills the rest of its ``max_num_batched_tokens`` with prompt chunks, in
the same forward: a long prompt is prefilled over several steps and running streams keep
getting a token per step (each step as slow as its chunk).

With a prefix cache (``replicas.prefix_cache``) an admitted sequence starts with the cached pages
of its prompt's prefix and is prefilled from there; those pages are not counted again, and
cached pages no sequence references count as free (they are evicted when needed). A compressing
policy's prompt in progress also holds a full-precision shadow of itself (its chunks attend to
it; its full pages become the cached prefix), counted as transient.

Before a decode step, a sequence whose next token needs new pages that the pool cannot give
preempts the most recently admitted running sequences: their cache is freed and they wait at the
front of the queue, to be prefilled again with prompt and output so far (vLLM's recompute
preemption).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from replicas.kv_cache import KVCache, Precision
from replicas.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """Attributes:
        max_num_seqs: sequences running at once.
        max_num_batched_tokens: prompt tokens prefilled in one step (without chunked prefill at
            least one whole prompt is always admitted when memory allows, whatever its length).
        enable_chunked_prefill: split prompts longer than the step's token budget over steps.
        compresses_chunks: the KV policy compresses a prompt after each chunk (its spec's
            ``compresses_chunks``): with chunked prefill a prompt in progress then holds at most
            its compressed size plus one chunk, and admission counts that, not the whole prompt.
    """
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = False
    compresses_chunks: bool = False

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError(f"scheduler limits must be >= 1: {self}")


@dataclass(frozen=True)
class PrefillWork:
    """Tokens ``[start, end)`` of ``seq`` to prefill this step; ``is_last``: the prompt is then
    whole in the cache (the step samples its first token)."""
    seq: Sequence
    start: int
    end: int

    @property
    def is_last(self) -> bool:
        return self.end == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    prefill: list[PrefillWork] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVCache):
        self.cfg, self.kv = cfg, kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and free its cache."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free_sequence(seq.request_id)

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s KV cache and put it first in the waiting queue (recompute later)."""
        if seq in self.running:
            self.running.remove(seq)
        self._requeue(seq)

    def _requeue(self, seq: Sequence) -> None:
        self.kv.free_sequence(seq.request_id)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens, seq.prefilled, seq.prefill_state = 0, False, None
        seq.metrics.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        chunked = self.cfg.enable_chunked_prefill
        if chunked:                 # every prefilled sequence decodes in every step, beside chunks
            self._decode(out)
        decoding = out.decode if chunked else [s for s in self.running if s.prefilled]
        reserve = self.kv.next_step_bytes([s.request_id for s in decoding])
        budget_tokens = self.cfg.max_num_batched_tokens - len(out.decode)
        # With a prefix cache, a compressing policy's prompt in progress also has a full-precision
        # shadow (``KVCache.attach_prefix``): up to its full size, less its cached prefix.
        shadow = self.kv.prefix is not None and self.kv.prefix.shadow
        per_chunk = chunked and self.cfg.compresses_chunks and not shadow   # <= compressed + one chunk
        held, transient = 0, 0
        for seq in self.running:    # prompts in progress: their next chunk, and what they still need
            if seq.prefilled:
                continue
            full, compressed = self._sizes(seq)
            held += max(0, compressed - self.kv.sequence_bytes(seq.request_id))
            transient += 0 if per_chunk else full - compressed + (full if shadow else 0)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget_tokens)
            if n > 0 and reserve + self._chunk_bytes(n) <= self.kv.bytes_free:
                out.prefill.append(PrefillWork(seq, seq.num_computed_tokens, seq.num_computed_tokens + n))
                budget_tokens -= n
                transient += self._chunk_bytes(n) if per_chunk else 0
        while self.waiting and len(self.running) < self.cfg.max_num_seqs and budget_tokens > 0:
            seq = self.waiting[0]
            full, compressed = self._sizes(seq)
            # A cached prefix (full KV) is held already: not needed again, but its pages that no
            # sequence references, counted free until now, stop being evictable.
            hit, idle = self.kv.prefix_hit(seq.all_token_ids)
            hit_bytes = 0 if shadow else self.kv.full_kv_bytes(hit)   # a shadow's row copies its prefix
            first = min(seq.num_tokens - hit, budget_tokens) if chunked else seq.num_tokens - hit
            extra = self._chunk_bytes(first) if per_chunk else full - compressed
            if shadow:
                extra += full - self.kv.full_kv_bytes(hit)
            if reserve + held + max(0, compressed - hit_bytes) + transient + extra > self.kv.bytes_free - idle:
                break
            if out.prefill and seq.num_tokens - hit > budget_tokens and not chunked:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.kv.add_sequence(seq.request_id)
            start = seq.num_computed_tokens = seq.metrics.num_cached_tokens = \
                self.kv.attach_prefix(seq.request_id, seq.all_token_ids)
            self.running.append(seq)
            end = min(seq.num_tokens, start + budget_tokens) if chunked else seq.num_tokens
            out.prefill.append(PrefillWork(seq, start, end))
            held += max(0, compressed - hit_bytes)
            transient += extra
            budget_tokens -= end - start
        if out.prefill or chunked:
            return out
        return self._decode(out)

    def _chunk_bytes(self, n: int) -> int:
        """The most a chunk of ``n`` prompt tokens can add: HIGH in every layer, plus a page."""
        return self.kv.full_kv_bytes(n) + self.kv.cfg.num_layers * self.kv.page_cost(Precision.HIGH)

    def _sizes(self, seq: Sequence) -> tuple[int, int]:
        """Full-KV and compressed bytes of ``seq``'s tokens (compressed: ``kv_budget`` x full)."""
        full = self.kv.full_kv_bytes(seq.num_tokens)
        return full, min(full, math.ceil(seq.kv_budget * full))

    def _decode(self, out: SchedulerOutput) -> SchedulerOutput:
        """Every prefilled sequence, one token; the most recently admitted are preempted while the
        step's new pages do not fit."""
        while True:
            ready = [s for s in self.running if s.prefilled]
            if not ready:
                return out
            need = self.kv.next_step_bytes([s.request_id for s in ready])
            if need <= self.kv.bytes_free or len(self.running) == 1:
                break
            victim = self.running.pop()
            self._requeue(victim)
            out.preempted.append(victim)
        out.decode = ready
        return out
