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
    fewer than the most likely one). The sampling rows are processed together, each setting a
    per-row tensor (a row's filter is applied only where it asks for it); rows with a request
    seed draw from their own generator, the others in one ``multinomial`` call from
    ``generator``. A temperature so small that ``logits / T`` overflows samples greedily.
    """
    for i, seq in enumerate(seqs):
        if seq.params.has_penalties:
            masked = torch.isneginf(logits[i])
            apply_penalties(logits[i], seq)
            logits[i].masked_fill_(masked | torch.isnan(logits[i]), float("-inf"))  # never unmask
    out = logits.argmax(dim=-1).tolist()
    rows = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
    if not rows:
        return out
    params = [seqs[i].params for i in rows]
    vocab = logits.shape[-1]
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    probs = torch.softmax(logits[rows] / temps[:, None], dim=-1)                    # [n, V]
    finite = torch.isfinite(probs).all(dim=-1).tolist()
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        k = torch.tensor([x or vocab for x in ks], device=probs.device)
        kth = probs.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        on = torch.tensor([x > 0 for x in ks], device=probs.device)[:, None]
        probs = torch.where(on & (probs < kth), 0.0, probs)     # ties at the k-th value are kept
    tops = [p.top_p for p in params]
    if any(t < 1.0 for t in tops):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        top_p = torch.tensor(tops, dtype=probs.dtype, device=probs.device)[:, None]
        keep = (sorted_p.cumsum(-1) - sorted_p < top_p * sorted_p.sum(-1, keepdim=True)) | (top_p >= 1.0)
        keep[:, 0] = True  # a top_p under float32's resolution (1e-237 is 0 there) keeps the top token
        probs = torch.zeros_like(probs).scatter_(1, order, torch.where(keep, sorted_p, 0.0))
    min_ps = [p.min_p for p in params]
    if any(m > 0.0 for m in min_ps):
        min_p = torch.tensor(min_ps, dtype=probs.dtype, device=probs.device)[:, None]
        probs = torch.where(probs >= min_p * probs.amax(-1, keepdim=True), probs, 0.0)
    probs = probs.cpu()
    shared = [j for j, i in enumerate(rows) if finite[j] and seqs[i].generator is None]
    if shared:
        for j, t in zip(shared, torch.multinomial(probs[shared], 1, generator=generator)[:, 0].tolist()):
            out[rows[j]] = t
    for j, i in enumerate(rows):
        if finite[j] and seqs[i].generator is not None:
            out[i] = int(torch.multinomial(probs[j], 1, generator=seqs[i].generator).item())
    return out
