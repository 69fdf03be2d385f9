"""Continuous batching: admission by KV memory in compressed bytes, preemption by recompute.

Each step is either a prefill step (admit waiting sequences, FIFO, while their KV fits the free
bytes) or a decode step (every running sequence, one token). Admission counts *compressed* bytes:
a sequence is prefilled whole (at HIGH, or for PASK at its table's precisions) and its policy
compresses it to at most ``kv_budget`` x full KV before the next one is prefilled, so the step needs the compressed size of every admitted
sequence plus the largest transient (full minus compressed) of one. That is how a third of the KV
becomes about three times the batch. Before a decode step, a
sequence whose next token needs new pages that the pool cannot give preempts the most recently
admitted running sequences: their cache is freed and they wait at the front of the queue, to be
prefilled again with prompt and output so far (vLLM's recompute preemption).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from replicas.kv_cache import KVCache
from replicas.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """Attributes:
        max_num_seqs: sequences running at once.
        max_num_batched_tokens: prompt tokens prefilled in one step (at least one sequence is
            always admitted when memory allows, whatever its length).
    """
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 8192

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError(f"scheduler limits must be >= 1: {self}")


@dataclass
class SchedulerOutput:
    prefill: list[Sequence] = field(default_factory=list)
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
        self.kv.free_sequence(seq.request_id)
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        reserve = self.kv.next_step_bytes([s.request_id for s in self.running])
        budget_tokens = self.cfg.max_num_batched_tokens
        held, transient = 0, 0
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            full = self.kv.full_kv_bytes(seq.num_tokens)
            compressed = min(full, math.ceil(seq.kv_budget * full))
            if reserve + held + compressed + max(transient, full - compressed) > self.kv.bytes_free:
                break
            if out.prefill and seq.num_tokens > budget_tokens:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.kv.add_sequence(seq.request_id)
            self.running.append(seq)
            out.prefill.append(seq)
            held += compressed
            transient = max(transient, full - compressed)
            budget_tokens -= seq.num_tokens
        if out.prefill:
            return out
        while self.running:
            need = self.kv.next_step_bytes([s.request_id for s in self.running])
            if need <= self.kv.bytes_free or len(self.running) == 1:
                break
            victim = self.running.pop()
            self.kv.free_sequence(victim.request_id)
            victim.status = SequenceStatus.WAITING
            victim.metrics.num_preemptions += 1
            self.waiting.appendleft(victim)
            out.preempted.append(victim)
        out.decode = list(self.running)
        return out
