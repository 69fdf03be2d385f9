"""Runs the model over the KV cache: prefill (one sequence at a time, causal SDPA) and batched
decode (one token per sequence, paged attention over the kept HIGH + LOW entries, as the step's
``DecodePlan`` lays them out)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from replicas.kv_cache import DecodePlan, KVCache, Precision
from replicas.models import CausalLM
from replicas.models.llama import causal_attention
from replicas.sequence import Sequence


class ModelRunner:
    def __init__(self, model: CausalLM, kv: KVCache, device: torch.device):
        self.model, self.kv, self.device = model, kv, device

    @torch.inference_mode()
    def prefill(self, seq: Sequence, observation_window: int = 0, window_ppl: bool = False,
                targets: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor], float | None]:
        """Prefill all of ``seq``'s tokens (an empty cache) and store their KV, at HIGH precision
        or, with ``targets [n, L]`` (Precision values), each token at its target in every layer.

        Returns the next-token logits ``[vocab]`` float32; per layer, the queries of the last
        ``observation_window`` tokens ``[w, Hq, D]``; and, when ``window_ppl``, the perplexity of
        those window tokens under the model (exp of their mean NLL), else None.
        """
        ids = torch.tensor(seq.all_token_ids, dtype=torch.long, device=self.device)
        n = ids.shape[0]
        positions = torch.arange(n, device=self.device)
        queries: dict[int, torch.Tensor] = {}

        def attention(layer: int, q, k, v):
            self.kv.append(seq.request_id, layer, range(n), k, v,
                           Precision.HIGH if targets is None else targets[:, layer])
            if observation_window:
                queries[layer] = q[-observation_window:].clone()
            return causal_attention(q, k, v)

        hidden = self.model(ids, positions, attention)
        ppl = None
        if window_ppl and observation_window and n > 1:
            w = min(observation_window, n - 1)
            logits = self.model.logits(hidden[-w - 1:-1])
            ppl = float(torch.exp(F.cross_entropy(logits, ids[-w:])))
        return self.model.logits(hidden[-1:])[0], queries, ppl

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
