"""Runs the model over the KV cache: prefill (chunks of one or several prompts in one forward,
causal SDPA per chunk) and batched decode (one token per sequence, paged attention over the kept
HIGH + LOW entries, as the step's ``DecodePlan`` lays them out)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from replicas.kv_cache import DecodePlan, KVCache, Precision
from replicas.models import CausalLM
from replicas.models.llama import causal_attention, decode_steps_attention, prefix_causal_attention
from replicas.sequence import Sequence


@dataclass(frozen=True)
class PrefillChunk:
    """Tokens ``token_ids`` at positions ``start ...`` of sequence ``seq_id``; ``targets``:
    ``[n, L]`` Precision values to store them at (None: HIGH); ``is_last``: the prompt ends here;
    ``attend_id``: a full-precision shadow row (prefix caching of a compressing policy) that the
    chunk attends to instead of ``seq_id``'s row, and stores its KV in at HIGH as well;
    ``draft``: the chunk is a sequence's last sampled token and its jump-forward draft: each token
    attends as a decode step of its own would (to the entries kept before it, at the precision
    they are stored at, and to itself), and the logits after every token are returned (the draft
    is verified against them)."""
    seq_id: str
    token_ids: list[int]
    start: int
    targets: torch.Tensor | None = None
    is_last: bool = True
    attend_id: object = None
    draft: bool = False


class PrefillResult(NamedTuple):
    logits: torch.Tensor | None            # [vocab] float32 after the last token (is_last only);
                                           # [n, vocab] after each token of a draft
    queries: dict[int, torch.Tensor]       # layer -> [w, Hq, D] queries of the chunk's last tokens
    hidden: torch.Tensor | None            # [k, hidden] the chunk's last final hidden states


class ModelRunner:
    def __init__(self, model: CausalLM, kv: KVCache, device: torch.device):
        self.model, self.kv, self.device = model, kv, device
        self.graph = None   # replicas.decode_graph.DecodeGraph, when the engine compiles decode

    @torch.inference_mode()
    def forward(self, seqs: list[Sequence], plan: DecodePlan | None, chunks: list[PrefillChunk],
                record_queries: bool = False, observation_window: int = 0, keep_hidden: int = 0):
        """One forward over a step's tokens: first one decode token for each of ``seqs`` (its
        last token at its true position, its KV placed by ``plan``), then the prompt ``chunks``
        of one or several sequences (vLLM v1's mixed batch). Linear layers see every token at
        once; per layer, the decode rows are one store and one attention call over the plan's
        block tables (nothing per sequence), and each chunk is one causal SDPA call.

        A chunk starting at 0 attends causally to itself; a later chunk of the same prompt also
        attends to every entry its sequence keeps so far (as the cache holds them: HIGH, or
        dequantized INT8 / INT4 for a policy that stores the prompt at its targets), read before
        the chunk's own KV is stored (each token at HIGH, or at ``chunk.targets`` per layer).

        Returns ``(decode_logits [B, vocab] float32 or None, decode_queries, results)``:
        ``decode_queries`` per layer ``[B, Hq, D]`` when ``record_queries`` (else empty), and per
        chunk a :class:`PrefillResult`: the next-token logits ``[vocab]`` after its last token
        (only when ``is_last``; ``[n, vocab]`` after each of its tokens for a ``draft``), per layer the queries ``[min(w, n), Hq, D]`` of its last
        ``w = observation_window`` tokens, and its last ``keep_hidden`` final hidden states
        (for the window perplexity: :meth:`window_ppl`).

        Raises:
            KVCacheOutOfMemory: a chunk's pages do not fit (earlier layers may hold part of the
                step's KV: the caller preempts the step's sequences).
        """
        nd = len(seqs)
        sizes = [len(c.token_ids) for c in chunks]
        ids = [s.output_token_ids[-1] if s.output_token_ids else s.prompt_token_ids[-1] for s in seqs]
        decode_positions = (plan.positions if plan is not None and plan.positions is not None
                            else torch.tensor([s.num_tokens - 1 for s in seqs], dtype=torch.long))
        if (nd and not chunks and self.graph is not None and self.graph.supports(plan)
                and (self.graph.record_queries or not record_queries)):
            out = self.graph(torch.tensor(ids, dtype=torch.long, device=self.device),
                             decode_positions.to(self.device), plan)
            if out is not None:
                return out[0], out[1], []
        ids += [t for c in chunks for t in c.token_ids]
        positions = torch.cat([decode_positions] + [torch.arange(c.start, c.start + n) for c, n in zip(chunks, sizes)])
        bounds = [nd]
        for n in sizes:
            bounds.append(bounds[-1] + n)
        decode_queries: dict[int, torch.Tensor] = {}
        queries: list[dict[int, torch.Tensor]] = [{} for _ in chunks]
        kv = self.kv

        def attention(layer: int, q, k, v):
            outs = []
            if nd:
                qd, kd, vd = (q, k, v) if not chunks else (q[:nd], k[:nd], v[:nd])
                kv.store(plan, layer, kd, vd)
                if record_queries:
                    decode_queries[layer] = qd.clone()
                outs.append(kv.attend(plan, layer, qd, kd, vd))
            for i, c in enumerate(chunks):
                a, b = bounds[i], bounds[i + 1]
                qc, kc, vc = q[a:b], k[a:b], v[a:b]
                if c.draft:   # stored first: each token then reads what a decode step would
                    kv.append(c.seq_id, layer, range(c.start, c.start + b - a), kc, vc,
                              Precision.HIGH if c.targets is None else c.targets[:, layer])
                    outs.append(decode_steps_attention(qc, kc, vc, *kv.gather(c.seq_id, layer), c.start))
                    continue
                if c.start:
                    _, prior_k, prior_v = kv.gather(c.attend_id or c.seq_id, layer)
                    outs.append(prefix_causal_attention(qc, kc, vc, prior_k, prior_v))
                else:
                    outs.append(causal_attention(qc, kc, vc))
                kv.append(c.seq_id, layer, range(c.start, c.start + b - a), kc, vc,
                          Precision.HIGH if c.targets is None else c.targets[:, layer])
                if c.attend_id is not None:
                    kv.append(c.attend_id, layer, range(c.start, c.start + b - a), kc, vc)
                if observation_window:
                    queries[i][layer] = qc[-observation_window:].clone()
            return outs[0] if len(outs) == 1 else torch.cat(outs)

        hidden = self.model(torch.tensor(ids, dtype=torch.long, device=self.device), positions.to(self.device),
                            attention)
        last = [i for i, c in enumerate(chunks) if c.is_last]
        spans = [range(bounds[i] if chunks[i].draft else bounds[i + 1] - 1, bounds[i + 1]) for i in last]
        rows = list(range(nd)) + [r for span in spans for r in span]
        logits = self.model.logits(hidden if len(rows) == hidden.shape[0] else hidden[rows]) if rows else None
        chunk_logits, at = {}, nd
        for i, span in zip(last, spans):
            chunk_logits[i] = logits[at:at + len(span)] if chunks[i].draft else logits[at]
            at += len(span)
        results = [PrefillResult(chunk_logits.get(i), queries[i],
                                 hidden[max(bounds[i], bounds[i + 1] - keep_hidden):bounds[i + 1]] if keep_hidden else None)
                   for i in range(len(chunks))]
        return (logits[:nd] if nd else None), decode_queries, results

    def prefill(self, chunks: list[PrefillChunk], observation_window: int = 0,
                keep_hidden: int = 0) -> list[PrefillResult]:
        """:meth:`forward` with prompt chunks only; returns the chunks' results."""
        return self.forward([], None, chunks, False, observation_window, keep_hidden)[2]

    def decode(self, seqs: list[Sequence], plan: DecodePlan, record_queries: bool = False):
        """:meth:`forward` with decode rows only: ``(logits [B, vocab] float32, queries)``."""
        logits, queries, _ = self.forward(seqs, plan, [], record_queries)
        return logits, queries

    @torch.inference_mode()
    def window_ppl(self, hidden: torch.Tensor, token_ids: list[int]) -> float:
        """Perplexity (exp of the mean NLL) of ``token_ids [w]`` under the model, from the final
        hidden states ``[w + 1, hidden]`` of the tokens before each of them and the one after
        the last (only the first w are used)."""
        w = len(token_ids)
        logits = self.model.logits(hidden[:w])
        return float(torch.exp(F.cross_entropy(logits, torch.tensor(token_ids, device=logits.device))))
