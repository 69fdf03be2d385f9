"""Quantize-and-store into the LOW pool of the KV cache: symmetric int8 / int4, one scale per
(token, KV head).

Layout of a LOW pool, flattened over pages: ``data [S, H, D]`` int8 (bits=8) or ``[S, H, D // 2]``
uint8 (bits=4, two values per byte, element 2i in the low nibble, 2i+1 in the high nibble, two's
complement), ``scale [S, H]`` float32; ``S = num_pages * block_size`` slots.
Quantization: ``scale = max(|x|) / qmax`` (qmax 127 or 7), ``q = floor(x / scale + 0.5)`` clamped to
``[-qmax, qmax]``; dequantization ``x ~ q * scale``.
"""

from __future__ import annotations

import torch

try:  # Triton is optional: on a machine without it only the references run.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

QMAX = {8: 127, 4: 7}


def _check(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor, bits: int):
    if bits not in QMAX:
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    if x.dim() != 3 or not x.is_floating_point():
        raise ValueError(f"x must be a float tensor [N, H, D], got {tuple(x.shape)} {x.dtype}")
    n, h, d = x.shape
    if bits == 4 and d % 2:
        raise ValueError(f"int4 needs an even head_dim, got {d}")
    want = (d if bits == 8 else d // 2)
    if data.dim() != 3 or data.shape[1:] != (h, want):
        raise ValueError(f"data pool must be [S, {h}, {want}], got {tuple(data.shape)}")
    if data.dtype != (torch.int8 if bits == 8 else torch.uint8):
        raise ValueError(f"data pool dtype {data.dtype} does not match bits={bits}")
    if scale.shape != data.shape[:2] or scale.dtype != torch.float32:
        raise ValueError(f"scale pool must be float32 [S, {h}], got {tuple(scale.shape)} {scale.dtype}")
    if slots.shape != (n,):
        raise ValueError(f"slots must be [N={n}], got {tuple(slots.shape)}")


def quantize_ref(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [N, H, D]`` -> (data, scale [N, H] float32); data as in the module docstring."""
    qmax = QMAX[bits]
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp_min(1e-8) / qmax
    q = torch.floor(xf / scale[..., None] + 0.5).clamp_(-qmax, qmax).to(torch.int8)
    if bits == 8:
        return q, scale
    nib = (q.to(torch.int16) & 0xF).to(torch.uint8)
    return (nib[..., 0::2] | (nib[..., 1::2] << 4)), scale


def dequantize_ref(data: torch.Tensor, scale: torch.Tensor, bits: int,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_ref`: ``[..., H, D]`` in ``dtype``."""
    if bits == 8:
        q = data.float()
    else:
        lo = (data & 0xF).to(torch.int16)
        hi = (data >> 4).to(torch.int16)
        lo = torch.where(lo >= 8, lo - 16, lo)
        hi = torch.where(hi >= 8, hi - 16, hi)
        q = torch.stack([lo, hi], dim=-1).flatten(-2).float()
    return (q * scale[..., None]).to(dtype)


def quantize_store_ref(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
                       slots: torch.Tensor, bits: int) -> None:
    """Quantize ``x [N, H, D]`` and write it to flat ``slots [N]`` (int64) of a LOW pool, in place.

    Raises:
        ValueError: shapes or dtypes that do not match the layout in the module docstring.
    """
    _check(x, data, scale, slots, bits)
    q, s = quantize_ref(x, bits)
    data[slots] = q
    scale[slots] = s


if triton is not None:
    @triton.jit
    def _quantize_store_kernel(x_ptr, data_ptr, scale_ptr, slots_ptr,
                               stride_xn, stride_xh, stride_ds, stride_dh, stride_ss,
                               QMAX_: tl.constexpr, BITS: tl.constexpr, DH: tl.constexpr,
                               BLOCK: tl.constexpr):
        n = tl.program_id(0)
        h = tl.program_id(1)
        slot = tl.load(slots_ptr + n)
        offs = tl.arange(0, BLOCK)
        mask = offs < DH
        src = x_ptr + n * stride_xn + h * stride_xh
        dst = data_ptr + slot * stride_ds + h * stride_dh
        if BITS == 8:
            x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
            amax = tl.max(tl.abs(x), axis=0)
            s = tl.maximum(amax, 1e-8) / QMAX_
            q = tl.minimum(tl.maximum(tl.floor(x / s + 0.5), -QMAX_), QMAX_)
            tl.store(dst + offs, q.to(tl.int8), mask=mask)
        else:
            xe = tl.load(src + 2 * offs, mask=mask, other=0.0).to(tl.float32)
            xo = tl.load(src + 2 * offs + 1, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(xe), axis=0), tl.max(tl.abs(xo), axis=0))
            s = tl.maximum(amax, 1e-8) / QMAX_
            qe = tl.minimum(tl.maximum(tl.floor(xe / s + 0.5), -QMAX_), QMAX_).to(tl.int32)
            qo = tl.minimum(tl.maximum(tl.floor(xo / s + 0.5), -QMAX_), QMAX_).to(tl.int32)
            packed = (qe & 15) | ((qo & 15) << 4)
            tl.store(dst + offs, packed.to(tl.uint8), mask=mask)
        tl.store(scale_ptr + slot * stride_ss + h, s)


def quantize_store_triton(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
                          slots: torch.Tensor, bits: int) -> None:
    """Triton version of :func:`quantize_store_ref` (same contract)."""
    _check(x, data, scale, slots, bits)
    n, h, d = x.shape
    if n == 0:
        return
    x = x.contiguous()
    dh = d if bits == 8 else d // 2
    _quantize_store_kernel[(n, h)](
        x, data, scale, slots.contiguous(), x.stride(0), x.stride(1), data.stride(0),
        data.stride(1), scale.stride(0), QMAX_=QMAX[bits], BITS=bits, DH=dh,
        BLOCK=triton.next_power_of_2(dh))
