"""H2O: heavy hitters (largest accumulated attention) plus recent tokens, during prefill and decode.

Source: Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models", NeurIPS 2023 (arXiv:2306.14048), section 3 / Algorithm 1: a token's score is the
attention it has received, summed over all queries so far; the cache keeps the top scorers and the
most recent tokens, half of the budget each in the paper's experiments. Scores are summed over the
heads of a layer, since this cache keeps or releases a token for all heads of a layer together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replicas.policies.base import ScoredPolicy, attention_probs


@dataclass
class H2OPolicy(ScoredPolicy):
    """Attributes:
        recent_ratio: share of each layer's quota kept for the most recent tokens (paper: 0.5).
    """
    recent_ratio: float = 0.5
    name = "h2o"
    observation_window = 1 << 30  # every prompt query: accumulated attention over the prompt
    record_decode_queries = True

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.recent_ratio <= 1.0:
            raise ValueError(f"recent_ratio must be in [0, 1], got {self.recent_ratio}")

    def prefill_scores(self, view, layer, positions):
        pos, k, _ = view.kv.gather(view.seq.request_id, layer)
        q = view.queries[layer]
        q_pos = torch.arange(view.num_prefilled - q.shape[0], view.num_prefilled)
        scores = torch.zeros(positions.shape[0])
        scores[pos] = attention_probs(q, q_pos, k, pos)
        return scores

    def decode_score(self, view, layer):
        return 0.0  # accumulated below, from this step's query on

    def observe_decode(self, view):
        scores = view.seq.policy_state["scores"]
        for layer, q in view.queries.items():
            pos, k, _ = view.kv.gather(view.seq.request_id, layer)
            scores[layer][pos] += attention_probs(q[None], torch.tensor([view.position]), k, pos)

    def protected(self, seq, layer, positions, num_tokens, quota_tokens):
        recent = int(quota_tokens * self.recent_ratio)
        return positions >= num_tokens - recent
