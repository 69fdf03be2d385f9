"""The KV store write as PyTorch custom ops, for captured decode graphs.

Inside ``torch.compile``, an in-graph ``pool[slots] = k`` on a pool tensor the graph closes over is
functionalized: the graph computes a new pool and copies it back, so every call copies the whole
pool. Measured on the CPU (inductor, the embedded model, batch 8, 512-token contexts, full KV):
one decode forward took 42.5 ms with a 64 MiB pool and 374.6 ms with a 1 GiB pool, against 6.5 ms
eager. Declared as custom ops that mutate their pool arguments (``mutates_args``), the writes stay
in place (inductor re-inplaces them) and the same forward took 5.6-6.2 ms at either pool size.
vLLM does the same with its ``reshape_and_cache`` op.

Shapes (the pools are passed whole, not as views: a view of a closed-over tensor is
functionalized again):
    k_pool, v_pool  ``[P, bs, Hkv, D]`` float (HIGH) or ``[P, bs, Hkv, D']`` int8 / uint8 (LOW,
                    see :mod:`kernels.quantize`)
    k_scale, v_scale  ``[P, bs, Hkv]`` float32 (LOW only)
    slots           ``[N]`` int64 flat slot of each new token (page x bs + offset)
    k, v            ``[N, Hkv, D]`` float
"""

from __future__ import annotations

import torch


@torch.library.custom_op("structkv::store_high", mutates_args=("k_pool", "v_pool"))
def store_high(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> None:
    """Write ``k, v`` at ``slots`` of a HIGH pool, in the pool's dtype."""
    k_pool.flatten(0, 1)[slots] = k.to(k_pool.dtype)
    v_pool.flatten(0, 1)[slots] = v.to(v_pool.dtype)


@torch.library.custom_op("structkv::store_low", mutates_args=("k_pool", "v_pool", "k_scale", "v_scale"))
def store_low(k_pool: torch.Tensor, v_pool: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
              slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bits: int) -> None:
    """Quantize ``k, v`` to ``bits`` (8 or 4) and write data and scales at ``slots`` of a LOW pool
    (the Triton kernel on CUDA, the reference elsewhere: :func:`kernels.quantize_store`)."""
    from kernels import quantize_store
    quantize_store(k, k_pool.flatten(0, 1), k_scale.flatten(0, 1), slots, bits)
    quantize_store(v, v_pool.flatten(0, 1), v_scale.flatten(0, 1), slots, bits)


__all__ = ["store_high", "store_low"]
