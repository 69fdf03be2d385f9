"""The decode step's KV store, written so that a compiled or captured decode graph keeps it in place.

Inside ``torch.compile``, a write through a *view* of a pool (``pool.flatten(0, 1)[slots] = k``)
is functionalized: the graph computes a new pool and copies it back, so every call copies the
whole pool. Measured on the CPU (inductor, the embedded model, batch 8, 512-token contexts, full
KV): one decode forward took 42.5 ms with a 64 MiB pool and 374.6 ms with a 1 GiB pool, against
6.5 ms eager. Indexing the pool tensor itself (``pool.index_put_((page, offset), k)``, no view) is
an in-place mutation of a graph input, which inductor keeps as a scatter of the new slots: no
kernel of the generated code spans a pool (``tests/replicas/test_capture.py``). PyTorch custom
ops that mutate the pools (vLLM's ``reshape_and_cache`` approach) kept the writes in place too,
but run their Python body on every call: a compiled forward of the 2-layer test model made 766
Python calls with them, 206 with ``index_put_`` (``cProfile``, inductor's C++ wrapper).

Shapes:
    k_pool, v_pool  ``[P, bs, Hkv, D]`` float (bits 0) or ``[P, bs, Hkv, D']`` int8 / uint8
                    (bits 8 / 4, see :mod:`kernels.quantize`)
    k_scale, v_scale  ``[P, bs, Hkv]`` float32 (bits 8 / 4), None for bits 0
    slots           ``[N]`` int64 flat slot of each new token (page x bs + offset)
    k, v            ``[N, Hkv, D]`` float
"""

from __future__ import annotations

import torch

from kernels.quantize import quantize_ref


def store_slots(k_pool: torch.Tensor, v_pool: torch.Tensor, k_scale: torch.Tensor | None,
                v_scale: torch.Tensor | None, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                bits: int) -> None:
    """Write ``k, v`` at ``slots`` of one pool, quantized to ``bits`` (0: in the pool's dtype;
    8 / 4: data and per-(token, head) scales, as :func:`kernels.quantize.quantize_ref`)."""
    bs = k_pool.shape[1]
    index = (torch.div(slots, bs, rounding_mode="floor"), torch.remainder(slots, bs))
    if bits == 0:
        k_pool.index_put_(index, k.to(k_pool.dtype))
        v_pool.index_put_(index, v.to(v_pool.dtype))
        return
    for x, data, scale in ((k, k_pool, k_scale), (v, v_pool, v_scale)):
        q, s = quantize_ref(x, bits)
        data.index_put_(index, q)
        scale.index_put_(index, s)


__all__ = ["store_slots"]
