"""SnapKV: observation-window voting with pooling, at prefill.

Source: Li et al., "SnapKV: LLM Knows What You Are Looking for Before Generation", NeurIPS 2024
(arXiv:2404.14469), section 4 / Listing 1: each prompt token's score is the attention it receives
from the last ``window_size`` prompt queries, summed, then smoothed by 1-D pooling over
``kernel_size`` neighbours; the window itself is kept. Defaults follow the authors' code (window 64,
kernel 5, average pooling), as NVIDIA kvpress does. Scores are summed over a layer's heads (this
cache keeps a token for all heads of a layer). Generated tokens are kept ahead of prompt tokens;
when the total budget forces it, the oldest go first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from replicas.policies.base import ScoredPolicy, attention_probs

PROTECT = 1e20  # above any attention score: window and generated tokens, ordered by recency


@dataclass
class SnapKVPolicy(ScoredPolicy):
    """Attributes:
        window_size: observation window (last prompt tokens whose queries vote).
        kernel_size: pooling width over neighbouring positions (odd).
        pooling: "avg" or "max".
    """
    window_size: int = 64
    kernel_size: int = 5
    pooling: str = "avg"
    name = "snapkv"
    static_scores = True   # prompt scores fixed at prefill; a generated token's grow with its position

    def __post_init__(self):
        super().__post_init__()
        if type(self.window_size) is not int or self.window_size < 1:
            raise ValueError(f"window_size must be a positive int, got {self.window_size!r}")
        if type(self.kernel_size) is not int or self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be a positive odd int, got {self.kernel_size!r}")
        if self.pooling not in ("avg", "max"):
            raise ValueError(f"pooling must be 'avg' or 'max', got {self.pooling!r}")

    @property
    def observation_window(self) -> int:
        return self.window_size

    def prefill_scores(self, view, layer, positions):
        n = view.num_prefilled
        pos, k, _ = view.kv.gather(view.seq.request_id, layer)
        q = view.queries[layer]
        w = q.shape[0]
        votes = torch.zeros(n)
        votes[pos] = attention_probs(q, torch.arange(n - w, n), k, pos)
        pool = F.avg_pool1d if self.pooling == "avg" else F.max_pool1d
        pad = self.kernel_size // 2
        smoothed = pool(votes[None, None], self.kernel_size, stride=1, padding=pad)[0, 0]
        if self.pooling == "avg":  # avg_pool1d counts padding; rescale the edges
            ones = F.avg_pool1d(torch.ones(1, 1, n), self.kernel_size, stride=1, padding=pad)[0, 0]
            smoothed = smoothed / ones
        # The window, and generated tokens when a preempted sequence is recomputed (as decode ranks them).
        window = (positions >= n - w) | (positions >= len(view.seq.prompt_token_ids))
        smoothed[window] = PROTECT + positions[window].float()
        return smoothed

    def decode_scores(self, seqs, positions, num_layers):
        score = (PROTECT + positions.numpy().astype(np.float64)).astype(np.float32)   # (NumPy: per step)
        return torch.from_numpy(score[:, None].repeat(num_layers, axis=1))
