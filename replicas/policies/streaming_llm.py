"""StreamingLLM: attention sinks plus a window of recent tokens.

Source: Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024
(arXiv:2309.17453), section 3.2: keep the first ``num_sinks`` tokens (4 in the paper) and the most
recent ones; here the recent window fills the rest of each layer's budget. In a chunked prefill
the prompt is brought to that set after every chunk (``compresses_chunks``), so a later chunk
attends to the sinks and the window, as in the paper's streaming setting, and the prompt never
holds more than its budget plus one chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

from replicas.policies.base import KEEP, ScoredPolicy


@dataclass
class StreamingLLMPolicy(ScoredPolicy):
    """Attributes:
        num_sinks: initial tokens always kept (the paper's 4 attention sinks).
    """
    num_sinks: int = 4
    name = "streaming_llm"
    static_scores = True   # prompt scores fixed at prefill; a generated token's grow with its position
    compresses_chunks = True   # sinks and recency: scores depend on positions only

    def __post_init__(self):
        super().__post_init__()
        if self.num_sinks < 0:
            raise ValueError(f"num_sinks must be >= 0, got {self.num_sinks}")

    def min_tokens_per_layer(self) -> int:
        return self.num_sinks

    def prefill_scores(self, view, layer, positions):
        s = positions.float()
        s[: self.num_sinks] = KEEP
        return s
