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
from replicas.models.llama import causal_attention, prefix_causal_attention
from replicas.sequence import Sequence


@dataclass(frozen=True)
class PrefillChunk:
    """Tokens ``token_ids`` at positions ``start ...`` of sequence ``seq_id``; ``targets``:
    ``[n, L]`` Precision values to store them at (None: HIGH); ``is_last``: the prompt ends here."""
    seq_id: str
    token_ids: list[int]
    start: int
    targets: torch.Tensor | None = None
    is_last: bool = True


class PrefillResult(NamedTuple):
    logits: torch.Tensor | None            # [vocab] float32 after the last token (is_last only)
    queries: dict[int, torch.Tensor]       # layer -> [w, Hq, D] queries of the chunk's last tokens
    hidden: torch.Tensor | None            # [k, hidden] the chunk's last final hidden states


class ModelRunner:
    def __init__(self, model: CausalLM, kv: KVCache, device: torch.device):
        self.model, self.kv, self.device = model, kv, device

    @torch.inference_mode()
    def prefill(self, chunks: list[PrefillChunk], observation_window: int = 0,
                keep_hidden: int = 0) -> list[PrefillResult]:
        """Prefill ``chunks`` (tokens of one or several sequences) in one forward and store their
        KV, each token at HIGH or, with ``chunk.targets``, at its target precision per layer.

        A chunk starting at 0 attends causally to itself; a later chunk of the same prompt also
        attends to every entry its sequence keeps so far (as the cache holds them: HIGH, or
        dequantized INT8 / INT4 for a policy that stores the prompt at its targets), read before
        the chunk's own KV is stored. Linear layers see every chunk's tokens at once; attention
        runs per chunk (one causal SDPA each).

        Returns, per chunk: the next-token logits ``[vocab]`` float32 after its last token (only
        when ``is_last``), per layer the queries ``[min(w, n), Hq, D]`` of its last
        ``w = observation_window`` tokens, and its last ``keep_hidden`` final hidden states
        ``[min(keep_hidden, n), hidden]`` (for the window perplexity: :meth:`window_ppl`).

        Raises:
            KVCacheOutOfMemory: a chunk's pages do not fit (earlier layers may hold its KV: the
                caller preempts the sequence).
        """
        sizes = [len(c.token_ids) for c in chunks]
        ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(c.start, c.start + n) for c, n in zip(chunks, sizes)]).to(self.device)
        bounds = [0]
        for n in sizes:
            bounds.append(bounds[-1] + n)
        queries: list[dict[int, torch.Tensor]] = [{} for _ in chunks]
        kv = self.kv

        def attention(layer: int, q, k, v):
            outs = []
            for i, c in enumerate(chunks):
                a, b = bounds[i], bounds[i + 1]
                qc, kc, vc = q[a:b], k[a:b], v[a:b]
                if c.start:
                    _, prior_k, prior_v = kv.gather(c.seq_id, layer)
                    outs.append(prefix_causal_attention(qc, kc, vc, prior_k, prior_v))
                else:
                    outs.append(causal_attention(qc, kc, vc))
                kv.append(c.seq_id, layer, range(c.start, c.start + b - a), kc, vc,
                          Precision.HIGH if c.targets is None else c.targets[:, layer])
                if observation_window:
                    queries[i][layer] = qc[-observation_window:].clone()
            return outs[0] if len(outs) == 1 else torch.cat(outs)

        hidden = self.model(ids, positions, attention)
        last = [i for i, c in enumerate(chunks) if c.is_last]
        logits = self.model.logits(hidden[[bounds[i + 1] - 1 for i in last]]) if last else None
        rows = dict(zip(last, logits)) if last else {}
        return [PrefillResult(rows.get(i), queries[i],
                              hidden[max(bounds[i], bounds[i + 1] - keep_hidden):bounds[i + 1]] if keep_hidden else None)
                for i in range(len(chunks))]

    @torch.inference_mode()
    def window_ppl(self, hidden: torch.Tensor, token_ids: list[int]) -> float:
        """Perplexity (exp of the mean NLL) of ``token_ids [w]`` under the model, from the final
        hidden states ``[w + 1, hidden]`` of the tokens before each of them and the one after
        the last (only the first w are used)."""
        w = len(token_ids)
        logits = self.model.logits(hidden[:w])
        return float(torch.exp(F.cross_entropy(logits, torch.tensor(token_ids, device=logits.device))))

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence], plan: DecodePlan, record_queries: bool = False):
        """One decode step for ``seqs``: each feeds its last token at its true position. The KV
        of the new tokens goes where ``plan`` (``KVCache.plan_decode``) put it, at the precision it
        names; attention reads the plan's block tables. Per layer: one store per pool and one
        attention call per pool, nothing per sequence.

        Returns next-token logits ``[B, vocab]`` float32 and, when ``record_queries``, per layer
        the step's queries ``[B, Hq, D]`` (else an empty dict).
        """
        ids = torch.tensor([s.output_token_ids[-1] if s.output_token_ids else s.prompt_token_ids[-1] for s in seqs],
                           dtype=torch.long, device=self.device)
        positions = torch.tensor([s.num_tokens - 1 for s in seqs], device=self.device)
        queries: dict[int, torch.Tensor] = {}
        kv = self.kv

        def attention(layer: int, q, k, v):
            kv.store(plan, layer, k, v)
            if record_queries:
                queries[layer] = q.clone()
            return kv.attend(plan, layer, q, k, v)

        return self.model.logits(self.model(ids, positions, attention)), queries
