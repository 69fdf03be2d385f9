"""Teacher-forced replay of a finished generation under a KV precision map.

Calibration needs "what would this layer's attention output (or this continuation's NLL) be if
these KV entries had been kept at that precision", for many precision maps, without running the
engine. :func:`compressed_forward` answers it in one dense forward pass over ``prompt + output``
with the engine's semantics:

- prompt queries (prefill) attend to the full-precision prompt (the engine compresses after
  prefill);
- the query of a token at position ``i >= prompt_len`` (a decode step) sees every earlier entry
  ``j < i`` at its precision (released entries are masked out, INT8 / INT4 entries are quantized and
  dequantized exactly as the KV cache stores them) and its own entry at full precision (the engine
  writes it, attends, then applies the policy).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels.quantize import dequantize_ref, quantize_ref
from replicas.kv_cache import Precision
from replicas.models import CausalLM
from replicas.models.llama import causal_attention


def _degrade(x: torch.Tensor, precision: torch.Tensor) -> torch.Tensor:
    """``x [n, H, D]`` with rows at INT8 / INT4 replaced by their quantized-dequantized values."""
    out = x.clone()
    for prec, bits in ((Precision.INT8, 8), (Precision.INT4, 4)):
        rows = precision == int(prec)
        if rows.any():
            data, scale = quantize_ref(x[rows], bits)
            out[rows] = dequantize_ref(data, scale, bits, x.dtype)
    return out


@torch.inference_mode()
def compressed_forward(model: CausalLM, token_ids: torch.Tensor, prompt_len: int,
                       precision: torch.Tensor | None = None, capture: bool = False):
    """Replay ``token_ids`` with the KV precision map ``precision``.

    Args:
        model: the model (any dtype; CPU or CUDA).
        token_ids: ``[n]`` int64, the prompt followed by the generated tokens.
        prompt_len: number of prompt tokens (``1 <= prompt_len <= n``).
        precision: ``[L, n]`` int (``Precision`` values) per layer and position; None = all HIGH.
        capture: also return every layer's attention output.
    Returns:
        ``(logits [n, vocab] float32, outputs)``, ``outputs`` a list of ``L`` tensors
        ``[n - prompt_len, Hq * D]`` float32 (the attention outputs of the decode positions) when
        ``capture``, else an empty list.
    Raises:
        ValueError: a ``precision`` of the wrong shape or a bad ``prompt_len``.
    """
    n = token_ids.shape[0]
    num_layers = model.config.num_layers
    if not 1 <= prompt_len <= n:
        raise ValueError(f"prompt_len must be in [1, {n}], got {prompt_len}")
    if precision is not None and tuple(precision.shape) != (num_layers, n):
        raise ValueError(f"precision must be [{num_layers}, {n}], got {tuple(precision.shape)}")
    device = next(model.parameters()).device
    ids = token_ids.to(device)
    positions = torch.arange(n, device=device)
    outputs: list[torch.Tensor] = []
    m = n - prompt_len

    def attention(layer: int, q, k, v):
        out = causal_attention(q, k, v)
        if m and precision is not None:
            prec = precision[layer].to(device)
            groups = q.shape[1] // k.shape[1]
            k2 = _degrade(k, prec).repeat_interleave(groups, dim=1).transpose(0, 1).float()   # [Hq, n, D]
            v2 = _degrade(v, prec).repeat_interleave(groups, dim=1).transpose(0, 1).float()
            qd = q[prompt_len:].transpose(0, 1).float()                                        # [Hq, m, D]
            scale = 1.0 / math.sqrt(q.shape[-1])
            scores = qd @ k2.transpose(1, 2) * scale                                           # [Hq, m, n]
            rows = torch.arange(prompt_len, n, device=device)
            visible = (positions[None, :] < rows[:, None]) & (prec != int(Precision.RELEASED))[None, :]
            scores = scores.masked_fill(~visible[None], float("-inf"))
            k_self = k[prompt_len:].repeat_interleave(groups, dim=1).transpose(0, 1).float()  # [Hq, m, D]
            v_self = v[prompt_len:].repeat_interleave(groups, dim=1).transpose(0, 1).float()
            s_self = (qd * k_self).sum(-1, keepdim=True) * scale                              # [Hq, m, 1]
            probs = torch.cat([scores, s_self], dim=-1).softmax(-1)
            dec = probs[..., :n] @ v2 + probs[..., n:] * v_self                                # [Hq, m, D]
            out = out.clone()
            out[prompt_len:] = dec.transpose(0, 1).to(out.dtype)
        if capture:
            outputs.append(out[prompt_len:].reshape(m, -1).float())
        return out

    hidden = model(ids, positions, attention)
    return model.logits(hidden), outputs


def continuation_nll(logits: torch.Tensor, token_ids: torch.Tensor, prompt_len: int) -> float:
    """Mean negative log-likelihood (nats per token) of ``token_ids[prompt_len:]`` under ``logits``
    (``[n, vocab]``, from :func:`compressed_forward`); 0.0 when there is no continuation."""
    if prompt_len >= token_ids.shape[0]:
        return 0.0
    pred = logits[prompt_len - 1:-1]
    return float(F.cross_entropy(pred, token_ids[prompt_len:].to(pred.device)))
