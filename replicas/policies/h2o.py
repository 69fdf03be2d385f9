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

# The float32 keys one decode step's observation gathers at once, at most (bytes): layers go in
# groups under it (e.g. batch 8 x 2,048 tokens x 8 KV heads x 128: 64 MiB per layer, 4 per group).
OBSERVE_BYTES = 256 << 20


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
        the batch and every layer together: the HIGH pages of every (row, layer) are gathered in
        one index (H2O keeps everything at HIGH), softmax over each (row, layer)'s kept slots,
        then one scatter-add by the slots' positions. ``queries``: layer -> ``[B, Hq, D]``.
        Layers go in groups whose gathered keys stay under :data:`OBSERVE_BYTES` (one group on
        a small model; at Qwen3-4B's shapes a group holds a few layers)."""
        if not queries:
            return
        table, b = self.scores(kv), kv.blocks
        high = Precision.HIGH
        order = sorted(queries)
        lens = b.num_slots[high][rows][:, order]                                     # [B, L']
        width = int(lens.max())
        if not width:
            return
        k = kv.pools[high].k
        per_layer = rows.shape[0] * width * k.shape[2] * k.shape[3] * 4              # float32 keys of one layer
        step = max(1, OBSERVE_BYTES // max(1, per_layer))
        for start in range(0, len(order), step):
            group = order[start:start + step]
            self._observe_layers(table, kv, rows, group, torch.stack([queries[layer] for layer in group]),
                                 lens[:, start:start + step])

    @staticmethod
    def _observe_layers(table, kv, rows, layers, q, lens):
        """:meth:`observe_decode_batch` for ``layers`` (a list), ``q [L', B, Hq, D]``, ``lens [B, L']``."""
        b, high, bs = kv.blocks, Precision.HIGH, kv.cfg.block_size
        pool = kv.pools[high]
        width = int(lens.max())
        if not width:
            return
        lay = torch.tensor(layers)
        pages = b.block_table[high][rows][:, lay, :-(-width // bs)].long()           # [B, L', P]
        keys = pool.k[pages.to(pool.k.device)].flatten(2, 3)[:, :, :width].float()  # [B, L', T, Hkv, D]
        n, nl, hq, d = rows.shape[0], len(layers), q.shape[2], q.shape[3]
        hkv = keys.shape[3]
        qg = q.float().view(nl, n, hkv, hq // hkv, d)                                # GQA: no key copies
        scores = torch.einsum("lbkgd,bltkd->blkgt", qg, keys).flatten(2, 3) / math.sqrt(d)   # [B, L', Hq, T]
        valid = torch.arange(width)[None, None, :] < lens[:, :, None]               # [B, L', T]
        probs = scores.masked_fill(~valid[:, :, None, :].to(scores.device), float("-inf")).softmax(-1).sum(2).cpu()
        slot_pos = b.slot_position[high][rows][:, lay, :width].long()                # [B, L', T]
        r = rows[:, None, None].expand(n, nl, width)[valid]
        li = lay[None, :, None].expand(n, nl, width)[valid]
        table[r, li, slot_pos[valid]] += probs[valid]

    def protected_scores(self, scores, positions, num_tokens, quotas):
        recent = (quotas.double() * self.recent_ratio).floor().long()
        pos = positions if positions.dim() == 2 else positions[None, :]      # [n, T] or [T]
        mask = pos >= (num_tokens - recent)[:, None]
        return torch.where(mask, KEEP + pos.float(), scores)
