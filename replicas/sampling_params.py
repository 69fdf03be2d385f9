"""Per-request decoding settings."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from replicas.errors import InvalidRequestError

MAX_LOGPROBS = 20   # most alternatives per token (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class SamplingParams:
    """How to decode one request.

    Attributes:
        max_tokens: most tokens to generate (>= 1).
        temperature: 0 for greedy; otherwise softmax temperature.
        top_p: nucleus sampling mass in (0, 1].
        seed: per-request seed for reproducible sampling (None: the engine's generator).
        stop: strings that end generation (not included in the output text).
        stop_token_ids: extra token ids that end generation.
        include_stop_str_in_output: keep the stop string that ended generation in the text.
        ignore_eos: keep generating past EOS (benchmarks).
        top_k: sample among the k most likely tokens only (0 or -1: all).
        min_p: drop tokens less than ``min_p`` times as likely as the most likely one (0: none).
        repetition_penalty: in [0.01, 10]; > 1 discourages any token of the prompt or output (1: none).
        presence_penalty, frequency_penalty: in [-2, 2]; subtracted from an output token's logit
            once, and per occurrence (0: none).
        logit_bias: (token id, bias) pairs added to the logits before anything else (OpenAI's
            ``logit_bias``; bias in [-100, 100]).
        logprobs: return each generated token's log-probability with this many most likely
            alternatives (0 to ``MAX_LOGPROBS``); None returns none. The log-probabilities are the
            model's own distribution, before the grammar mask and the temperature (vLLM's
            default, "raw" log-probabilities).
    Raises:
        InvalidRequestError: a value out of range.
    """
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidRequestError(f"top_k must be an integer >= -1 (-1 or 0: all tokens), got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not 0.01 <= self.repetition_penalty <= 10.0:
            raise InvalidRequestError(f"repetition_penalty must be in [0.01, 10], got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in dict(self.logit_bias).items()))
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in self.logit_bias):
            raise InvalidRequestError("logit_bias maps token ids >= 0 to biases in [-100, 100]", "logit_bias")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidRequestError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings", "stop")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    # Cached (read per sequence per step: one dict lookup after the first, no call).
    @functools.cached_property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @functools.cached_property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias))
