"""A request's state inside the engine, and what the engine returns for it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from replicas.sampling_params import SamplingParams


class TokenLogprob(NamedTuple):
    """A generated token's log-probability and the most likely alternatives at its step,
    ``top`` as (token id, log-probability) pairs, most likely first."""
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Timings (seconds, ``time.monotonic``) and KV usage of one request.

    ``kv_ratio_*`` are bytes held / bytes full KV would hold for the same tokens, sampled after
    every step of the request (the "total KV budget" ratio).
    """
    arrival_s: float
    first_token_s: float | None = None
    finished_s: float | None = None
    kv_bytes_peak: int = 0
    kv_ratio_sum: float = 0.0
    kv_ratio_max: float = 0.0
    num_steps: int = 0
    num_preemptions: int = 0
    budget_fallbacks: int = 0
    num_forced_tokens: int = 0   # output tokens appended by jump-forward (no decode step of their own)
    num_draft_tokens: int = 0    # tokens jump-forward drafted (forced tokens: those the model then sampled)
    num_cached_tokens: int = 0   # prompt tokens taken from the prefix cache (at the last admission)

    def snapshot(self) -> "RequestMetrics":
        """A copy (what ``copy.copy`` gives, in three calls instead of about twelve: it runs
        for every sequence on every step)."""
        out = object.__new__(RequestMetrics)
        out.__dict__.update(self.__dict__)
        return out

    @property
    def kv_ratio_mean(self) -> float:
        return self.kv_ratio_sum / self.num_steps if self.num_steps else 0.0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s


@dataclass
class Sequence:
    """One request: prompt, output so far, decoding state (grammar matcher, RNG) and metrics."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    matcher: Any = None                       # replicas.grammar.Matcher (either backend) or None
    kv_budget: float = 1.0                    # effective total KV budget (fraction of full KV)
    requested_budget: float = 1.0             # what the request asked for (kv_budget <= it)
    floor_budget: float = 0.0                 # the policy's floor for this prompt (kv_budget >= it)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    text: str = ""
    generator: torch.Generator | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    policy_state: dict = field(default_factory=dict)  # owned by the KV policy (tags, scores ...)
    detokenizer: Any = None                   # replicas.detokenizer.IncrementalDetokenizer
    logprobs: list[TokenLogprob] | None = None  # one per output token, when params.logprobs is set
    sent_chars: int = 0                       # characters of ``text`` and tokens reported in outputs
    sent_tokens: int = 0
    # Prefill progress: tokens whose KV is in the cache while the prompt is prefilled (in chunks
    # with chunked prefill), and whether it is done (then the sequence decodes); both reset by a
    # preemption. ``prefill_state`` is the engine's (the policy's targets, window queries so far).
    num_computed_tokens: int = 0
    prefilled: bool = False
    prefill_state: dict | None = None
    # Jump-forward's draft: the tokens the grammar forces after the last sampled one, not output
    # yet. The next step feeds them after that token as one chunk and keeps those the model then
    # samples itself, in order (``LLMEngine._verify_draft``).
    draft_token_ids: list[int] = field(default_factory=list)
    # len(prompt_token_ids), which never changes: read for every sequence on every step.
    num_prompt_tokens: int = field(init=False, repr=False)

    def __post_init__(self):
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED


@dataclass(frozen=True)
class RequestOutput:
    """What the engine reports for a request after a step: what is new since its last output.

    ``new_token_ids``, ``new_text`` and ``new_logprobs`` (None unless asked for) are the deltas: over
    a request's outputs they add up to its whole output, each token reported once (no copy of what
    came before). The finished output (``finished``) also carries the whole output in
    ``token_ids``, ``text`` and ``logprobs``; an unfinished one has ``token_ids`` and ``text`` None.
    ``num_output_tokens`` counts the tokens generated so far.
    """
    request_id: str
    new_text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    metrics: RequestMetrics
    new_logprobs: list[TokenLogprob] | None = None
    text: str | None = None
    token_ids: list[int] | None = None
    logprobs: list[TokenLogprob] | None = None

    @classmethod
    def of(cls, seq: Sequence) -> "RequestOutput":
        """The request's news after a step, marked as reported in ``seq``. While it runs with stop
        strings, the text holds back its last ``max(len(stop)) - 1`` characters, which could be the
        start of a stop string (vLLM does the same), so text reported is never taken back."""
        text, done = seq.text, seq.status == SequenceStatus.FINISHED
        visible = len(text)
        if seq.params.stop and not done:
            visible = max(0, visible - max(map(len, seq.params.stop)) + 1)
        new_text = text[seq.sent_chars:visible] if visible > seq.sent_chars else ""
        seq.sent_chars = max(seq.sent_chars, visible)
        n, k = len(seq.output_token_ids), seq.sent_tokens
        seq.sent_tokens = n
        lps = seq.logprobs
        return cls(seq.request_id, new_text, seq.output_token_ids[k:], done, seq.finish_reason,
                   seq.num_prompt_tokens, n, seq.metrics.snapshot(),
                   None if lps is None else lps[k:],
                   text if done else None, list(seq.output_token_ids) if done else None,
                   None if lps is None or not done else list(lps))

