"""H2O: heavy hitters (largest accumulated attention) plus recent tokens, during prefill and decode.

Source: Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models", NeurIPS 2023 (arXiv:2306.14048), section 3 / Algorithm 1: a token's score is the
attention it has received, summed over all queries so far; the cache keeps the top scorers and the
most recent tokens, half of the budget each in the paper's experiments. Scores are summed over the
heads of a layer, since this cache keeps or releases a token for all heads of a layer together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from replicas.kv_cache import Precision
from replicas.policies.base import KEEP, ScoredPolicy, attention_probs


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

    def decode_scores(self, seqs, positions, num_layers):
        return torch.zeros(len(seqs), num_layers)  # accumulated below, from this step's query on

    def observe_decode_batch(self, seqs, kv, rows, positions, queries):
        """Add this step's attention (summed over query heads) to every kept token's score, for
        the batch and every layer at once: the HIGH pages of every (row, layer) are gathered in
        one index (H2O keeps everything at HIGH), softmax over each (row, layer)'s kept slots,
        then one scatter-add by the slots' positions. ``queries``: layer -> ``[B, Hq, D]``."""
        if not queries:
            return
        table, b = self.scores(kv), kv.blocks
        high, bs = Precision.HIGH, kv.cfg.block_size
        pool = kv.pools[high]
        layers = torch.tensor(sorted(queries))                                      # [L']
        q = torch.stack([queries[layer] for layer in layers.tolist()])               # [L', B, Hq, D]
        lens = b.num_slots[high][rows][:, layers]                                    # [B, L']
        width = int(lens.max())
        if not width:
            return
        pages = b.block_table[high][rows][:, layers, :-(-width // bs)].long()        # [B, L', P]
        keys = pool.k[pages.to(pool.k.device)].flatten(2, 3)[:, :, :width].float()  # [B, L', T, Hkv, D]
        hq, hkv = q.shape[2], keys.shape[3]
        keys = keys.repeat_interleave(hq // hkv, dim=3)                              # [B, L', T, Hq, D]
        scores = torch.einsum("lbhd,blthd->blht", q.float(), keys) / math.sqrt(q.shape[-1])
        valid = torch.arange(width)[None, None, :] < lens[:, :, None]               # [B, L', T]
        probs = scores.masked_fill(~valid[:, :, None, :].to(scores.device), float("-inf")).softmax(-1).sum(2).cpu()
        slot_pos = b.slot_position[high][rows][:, layers, :width].long()             # [B, L', T]
        n, nl = rows.shape[0], layers.shape[0]
        r = rows[:, None, None].expand(n, nl, width)[valid]
        lay = layers[None, :, None].expand(n, nl, width)[valid]
        table[r, lay, slot_pos[valid]] += probs[valid]

    def protected_scores(self, scores, positions, num_tokens, quotas):
        recent = (quotas.double() * self.recent_ratio).floor().long()
        mask = positions[None, :] >= (num_tokens - recent)[:, None]
        return torch.where(mask, KEEP + positions.float()[None, :], scores)
