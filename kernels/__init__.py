"""Kernels of the KV cache, each a Triton kernel beside a plain-torch reference ``<op>_ref``.

The registry picks Triton for CUDA tensors (when Triton imports) and the reference elsewhere;
``STRUCTKV_KERNELS=ref`` forces the references, ``STRUCTKV_KERNELS=triton`` the Triton kernels on
any device (on the CPU with ``TRITON_INTERPRET=1``). On the CPU the multi-pool decode attention
runs the fused C kernel (:mod:`kernels.cpu_attention`, compiled on first use) where it builds and
takes the inputs, else its reference. Importing this package never needs CUDA or a compiler.
"""

from __future__ import annotations

import os

import torch

from kernels.decode_attention import (merge_attention_states, paged_decode_attention_ref,
                                      paged_decode_attention_pools_ref, paged_decode_attention_static,
                                      paged_decode_attention_triton)
from kernels.quantize import dequantize_ref, quantize_ref, quantize_store_ref, quantize_store_triton
from kernels import cpu_attention as _cpu
from kernels import decode_attention as _da

_IMPLEMENTATIONS = {
    "quantize_store": (quantize_store_ref, quantize_store_triton),
    "paged_decode_attention": (paged_decode_attention_ref, paged_decode_attention_triton),
}


def use_triton(device: torch.device) -> bool:
    """Whether the Triton kernels run for tensors on ``device``."""
    choice = os.environ.get("STRUCTKV_KERNELS", "auto")
    if _da.triton is None or choice == "ref":
        return False
    return choice == "triton" or device.type == "cuda"


def get_kernel(name: str, device: torch.device):
    """The implementation of kernel ``name`` for ``device``.

    Raises:
        KeyError: an unknown kernel name.
    """
    ref, tri = _IMPLEMENTATIONS[name]
    return tri if use_triton(device) else ref


def quantize_store(x, data, scale, slots, bits: int) -> None:
    get_kernel("quantize_store", x.device)(x, data, scale, slots, bits)


def paged_decode_attention(q, k, v, k_scale, v_scale, block_table, lens, bits: int,
                           sm_scale: float | None = None, need_lse: bool = True, static: bool = False):
    """Decode attention over paged KV (Triton on CUDA, the torch reference elsewhere); see
    :func:`kernels.decode_attention.paged_decode_attention_ref` for shapes. Returns ``(out, lse)``;
    ``lse`` may be None when ``need_lse`` is False. ``static``: where the reference runs, the
    graph-capturable one (:func:`kernels.decode_attention.paged_decode_attention_static`)."""
    impl = get_kernel("paged_decode_attention", q.device)
    if static and impl is paged_decode_attention_ref:
        impl = paged_decode_attention_static
    return impl(q, k, v, k_scale, v_scale, block_table, lens, bits, sm_scale, need_lse=need_lse)


def paged_decode_attention_pools(q, pools, extra_kv=None, sm_scale: float | None = None):
    """Decode attention over several paged pools in one call, for CPU tensors: the fused C kernel
    (:func:`kernels.cpu_attention.paged_decode_attention_pools_cpu`) where it is built and takes
    the inputs, else the torch reference
    (:func:`kernels.decode_attention.paged_decode_attention_pools_ref`, same contract, same
    results to float32 rounding). ``STRUCTKV_KERNELS=ref`` forces the reference."""
    if os.environ.get("STRUCTKV_KERNELS", "auto") != "ref" and _cpu.supports(q, pools) and _cpu.available():
        return _cpu.paged_decode_attention_pools_cpu(q, pools, extra_kv, sm_scale)
    return paged_decode_attention_pools_ref(q, pools, extra_kv, sm_scale)


__all__ = ["paged_decode_attention_pools", "dequantize_ref", "get_kernel", "merge_attention_states", "paged_decode_attention",
           "paged_decode_attention_pools_ref", "paged_decode_attention_ref", "paged_decode_attention_static", "paged_decode_attention_triton", "quantize_ref",
           "quantize_store", "quantize_store_ref", "quantize_store_triton", "use_triton"]
