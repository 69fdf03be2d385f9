"""Greedy and temperature / top-k / top-p / min-p sampling with repetition, presence and
frequency penalties, per-request seeded (the logits processing of vLLM's sampler, in its order:
penalties, then temperature, then top-k, top-p and min-p)."""

from __future__ import annotations

import torch

from replicas.sequence import Sequence


def apply_penalties(logits: torch.Tensor, seq: Sequence) -> None:
    """Add the request's ``logit_bias`` to ``logits [vocab]`` and penalize the tokens ``seq``
    has seen, in place.

    repetition_penalty r (the CTRL paper's, as Hugging Face and vLLM apply it): a prompt or output
    token's logit is divided by r when positive and multiplied by r when not. presence_penalty p
    and frequency_penalty f (OpenAI's): an output token's logit drops by p once and by f per time
    it occurred.
    """
    p, vocab = seq.params, logits.shape[-1]
    if p.logit_bias:
        ids, bias = zip(*p.logit_bias)
        logits[list(ids)] += torch.tensor(bias, dtype=logits.dtype)
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.prompt_token_ids) | set(seq.output_token_ids)), dtype=torch.long)
        x = logits[seen]
        # A token the grammar masked (-inf) stays masked: -inf * r is NaN for an r that rounds to 0.
        logits[seen] = torch.where(torch.isfinite(x), torch.where(x > 0, x / p.repetition_penalty,
                                                                  x * p.repetition_penalty), x)
    if (p.presence_penalty or p.frequency_penalty) and seq.output_token_ids:
        counts = torch.bincount(torch.tensor(seq.output_token_ids, dtype=torch.long), minlength=vocab)[:vocab]
        logits -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty * (counts > 0).to(logits.dtype)


def sample(logits: torch.Tensor, seqs: list[Sequence], generator: torch.Generator) -> list[int]:
    """Pick one token per row of ``logits [B, vocab]`` (float32, already grammar-masked; rows
    with penalties are changed in place).

    Greedy rows take the argmax (after penalties); others sample from softmax(logits / T)
    restricted to the ``top_k`` most likely tokens, then to the smallest set whose mass reaches
    ``top_p``, then to the tokens at least ``min_p`` times as likely as the most likely one (never
    fewer than the most likely one), with the request's own generator when it gave a seed, else
    ``generator``. A temperature so small that ``logits / T`` overflows samples greedily.
    """
    for i, seq in enumerate(seqs):
        if seq.params.has_penalties:
            masked = torch.isneginf(logits[i])
            apply_penalties(logits[i], seq)
            logits[i].masked_fill_(masked | torch.isnan(logits[i]), float("-inf"))  # never unmask
    out = logits.argmax(dim=-1).tolist()
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.greedy:
            continue
        probs = torch.softmax(logits[i] / p.temperature, dim=-1)
        if not bool(torch.isfinite(probs).all()):
            continue  # the argmax already there
        if p.top_k > 0 and p.top_k < probs.shape[-1]:
            kth = probs.topk(p.top_k).values[-1]
            probs = torch.where(probs >= kth, probs, 0.0)   # ties at the k-th value are kept
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < p.top_p * sorted_p.sum()
            keep[0] = True  # a top_p under float32's resolution (1e-237 is 0 there) keeps the top token
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
        if p.min_p > 0.0:
            probs = torch.where(probs >= p.min_p * probs.max(), probs, 0.0)
        gen = seq.generator or generator
        out[i] = int(torch.multinomial(probs.cpu(), 1, generator=gen).item())
    return out
