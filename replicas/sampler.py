"""Greedy and temperature / top-p sampling, per-request seeded."""

from __future__ import annotations

import torch

from replicas.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence], generator: torch.Generator) -> list[int]:
    """Pick one token per row of ``logits [B, vocab]`` (float32, already grammar-masked).

    Greedy rows take the argmax; others sample from softmax(logits / T) restricted to the
    smallest set of tokens whose mass reaches top_p (never fewer than the most likely one), with
    the request's own generator when it gave a seed, else ``generator``. A temperature so small
    that ``logits / T`` overflows samples greedily.
    """
    out = logits.argmax(dim=-1).tolist()
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.greedy:
            continue
        probs = torch.softmax(logits[i] / p.temperature, dim=-1)
        if not bool(torch.isfinite(probs).all()):
            continue  # the argmax already there
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < p.top_p
            keep[0] = True  # a top_p under float32's resolution (1e-237 is 0 there) keeps the top token
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
        gen = seq.generator or generator
        out[i] = int(torch.multinomial(probs.cpu(), 1, generator=gen).item())
    return out
