"""Decode attention over one precision pool of the paged KV cache (ragged batch, GQA).

Each call attends every sequence's query to the entries it keeps in one pool (HIGH at the model
dtype, or LOW int8 / int4 with a scale per token and KV head) and returns the partial result with
its log-sum-exp, so results over several pools merge exactly (:func:`merge_attention_states`, the
split-KV merge of FlashDecoding).

Shapes:
    q            [B, Hq, D] float (any float dtype), Hq = G * Hkv (query heads of KV head h are
                 h*G ... h*G + G - 1, as in Hugging Face's ``repeat_kv``)
    k, v         [P, bs, Hkv, D] (bits=0, float), [P, bs, Hkv, D] int8 (bits=8),
                 [P, bs, Hkv, D // 2] uint8 (bits=4)
    k_scale, v_scale  [P, bs, Hkv] float32, or None for bits=0
    block_table  [B, max_pages] int32: page ids of each sequence in slot order (padding: any id)
    lens         [B] int32: entries kept by each sequence in this pool
Returns ``out [B, Hq, D]`` float32 and ``lse [B, Hq]`` float32 (``-inf`` and zeros for an empty row).
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from kernels.quantize import dequantize_ref

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def _check(q, k, v, k_scale, v_scale, block_table, lens, bits):
    if bits not in (0, 8, 4):
        raise ValueError(f"bits must be 0 (HIGH), 8 or 4, got {bits}")
    if q.dim() != 3 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"q must be [B, Hq, D] and k, v equal [P, bs, Hkv, Dk]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    b, hq, d = q.shape
    hkv = k.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of KV heads {hkv}")
    want = d // 2 if bits == 4 else d
    if k.shape[3] != want:
        raise ValueError(f"pool head_dim {k.shape[3]} does not match q head_dim {d} for bits={bits}")
    if bits and (k_scale is None or k_scale.shape != k.shape[:3] or v_scale.shape != k.shape[:3]):
        raise ValueError("quantized pools need k_scale, v_scale of shape [P, bs, Hkv]")
    if block_table.dim() != 2 or block_table.shape[0] != b or lens.shape != (b,):
        raise ValueError(f"block_table must be [B={b}, max_pages] and lens [B]; got "
                         f"{tuple(block_table.shape)}, {tuple(lens.shape)}")


_WORKSPACE: dict = {}


def _workspace(name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reused buffer of ``shape`` for gathered pages: filling a fresh allocation each call cost
    7x the copy itself on the CPU (page faults). Valid until the next call with the same name."""
    numel = math.prod(shape)
    key = (name, dtype, device)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: writable in and outside inference mode
            buf = _WORKSPACE[key] = torch.empty(max(numel, 2 * (buf.numel() if buf is not None else 0)),
                                                dtype=dtype, device=device)
    return buf[:numel].view(shape)


# Sequences are attended in equal chunks whose gathered keys and values (float32) take about this
# many bytes, so a chunk is still in the last-level cache when attention reads it back. Measured on
# this project's 2-core EPYC (32 MiB L3), batch 8, 6 layers, medians of decode steps: at 3,840
# tokens of context one 31 MiB gather per layer took 24-25 ms a step, two chunks of 4 sequences
# 15.7-16.4 ms; 8 and 16 MiB chunks were equal at 2,048 and 3,840 tokens; chunks of one sequence
# were slower again (call overhead).
GATHER_CHUNK_BYTES = 16 << 20


def paged_decode_attention_ref(q, k, v, k_scale, v_scale, block_table, lens, bits: int,
                               sm_scale: float | None = None, need_lse: bool = True):
    """Plain-torch reference: gathers each chunk of sequences' pages (:data:`GATHER_CHUNK_BYTES`)
    into a reused buffer, dequantizes, then a masked softmax one KV head at a time. With
    ``need_lse=False`` (nothing to merge with) the log-sum-exp is not needed and a chunk is one
    PyTorch SDPA call (its fused CPU kernel), and ``lse`` comes back as None."""
    _check(q, k, v, k_scale, v_scale, block_table, lens, bits)
    b, hq, d = q.shape
    hkv = k.shape[2]
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    out = torch.zeros(b, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, hq), float("-inf"), dtype=torch.float32, device=q.device)
    lens_list = lens.tolist()
    if not b or max(lens_list) == 0:
        return out, (lse if need_lse else None)
    qg = q.float().view(b, hkv, hq // hkv, d)
    token_bytes = 2 * hkv * d * 4                    # gathered K and V of one token, float32
    # Equal chunks of consecutive sequences, as few as keep each under GATHER_CHUNK_BYTES.
    num_chunks = max(1, min(b, -(-sum(lens_list) * token_bytes // GATHER_CHUNK_BYTES)))
    size = -(-b // num_chunks)
    for start in range(0, b, size):
        stop = min(b, start + size)
        max_len = max(lens_list[start:stop])
        if max_len:
            o, l = _attend_chunk(qg[start:stop], k, v, k_scale, v_scale, block_table[start:stop],
                                 lens[start:stop], lens_list[start:stop], max_len, bits, sm_scale, need_lse)
            out[start:stop] = o.view(stop - start, hq, d)
            if need_lse:
                lse[start:stop] = l.view(stop - start, hq)
    return out, (lse if need_lse else None)


def _attend_chunk(qg, k, v, k_scale, v_scale, block_table, lens, lens_list, max_len: int, bits: int,
                  sm_scale: float, need_lse: bool):
    """Attention of ``qg [c, Hkv, G, D]`` float32 over the first ``max_len`` (> 0) kept entries
    of c sequences. Returns ``out [c, Hkv, G, D]`` and ``lse [c, Hkv, G]`` (None without
    ``need_lse``; an empty row gives zeros and ``-inf``)."""
    c, hkv, g, d = qg.shape
    bs = k.shape[1]
    num_pages = -(-max_len // bs)
    pages = block_table[:, :num_pages].long()

    def gather(pool, scale, name):
        shape = (c * num_pages,) + tuple(pool.shape[1:])
        x = torch.index_select(pool, 0, pages.reshape(-1), out=_workspace(name, shape, pool.dtype, pool.device))
        x = x.view(c, num_pages * bs, *pool.shape[2:])[:, :max_len]    # [c, T, Hkv, Dk]
        if bits:
            x = dequantize_ref(x, scale[pages].flatten(1, 2)[:, :max_len], bits)
        return x.float()

    keys, values = gather(k, k_scale, "k"), gather(v, v_scale, "v")       # [c, T, Hkv, D]
    ragged = min(lens_list) < max_len
    if not need_lse:
        mask = None
        if ragged:
            mask = (torch.arange(max_len, device=qg.device)[None, :] < lens[:, None].to(qg.device))[:, None, None, :]
        o = F.scaled_dot_product_attention(qg.reshape(c, hkv * g, 1, d), keys.transpose(1, 2), values.transpose(1, 2),
                                           attn_mask=mask, scale=sm_scale, enable_gqa=True)
        return o.view(c, hkv, g, d).nan_to_num_(0.0), None
    out = torch.empty(c, hkv, g, d, dtype=torch.float32, device=qg.device)
    lse = torch.empty(c, hkv, g, dtype=torch.float32, device=qg.device)
    if ragged:
        valid = torch.arange(max_len, device=qg.device)[None, :] < lens[:, None].to(qg.device)
    # One KV head at a time: [c, T, D] slices of the gathered pages are strided matrices that bmm
    # reads in place, where one einsum over all heads copied the whole context again.
    for h in range(hkv):
        scores = torch.bmm(qg[:, h], keys[:, :, h].transpose(1, 2)).mul_(sm_scale)   # [c, G, T]
        if ragged:
            scores.masked_fill_(~valid[:, None, :], float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)                                   # [c, G]
        probs = torch.exp(scores - row_lse[..., None]).nan_to_num_(0.0)   # an empty row: zeros
        lse[:, h] = row_lse
        out[:, h] = torch.bmm(probs, values[:, :, h])
    return out, lse


def paged_decode_attention_static(q, k, v, k_scale, v_scale, block_table, lens, bits: int,
                                  sm_scale: float | None = None, need_lse: bool = True):
    """Graph-capturable reference (same contract as :func:`paged_decode_attention_ref`): no
    shape or value is read back to the host, so ``torch.compile(fullgraph=True)`` and CUDA graphs
    capture it. It gathers the whole block table's width (a batch bucket's static shape) and masks
    past each row's length; the chunked reference is faster in eager mode on the CPU."""
    b, hq, d = q.shape
    hkv, bs = k.shape[2], k.shape[1]
    g = hq // hkv
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    pages = block_table.long()                                                  # [B, P]
    width = pages.shape[1] * bs

    def gather(pool, scale):
        x = pool[pages].flatten(1, 2)                                           # [B, P*bs, Hkv, Dk]
        if bits:
            x = dequantize_ref(x, scale[pages].flatten(1, 2), bits)
        return x.float()

    keys, values = gather(k, k_scale), gather(v, v_scale)
    qg = q.float().view(b, hkv, g, d)
    scores = torch.einsum("bhgd,bthd->bhgt", qg, keys) * sm_scale               # [B, Hkv, G, T]
    valid = torch.arange(width, device=q.device)[None, :] < lens.to(q.device).long()[:, None]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                       # [B, Hkv, G]
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhgt,bthd->bhgd", probs, values).reshape(b, hq, d)
    return out, (lse.reshape(b, hq) if need_lse else None)


def _dequantize_into(x: torch.Tensor, scale: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """Write ``x * scale`` into ``out [..., Hkv, D]`` float32 (converted, then scaled in place).

    ``x``: ``[..., Hkv, D]`` float (bits 0, ``scale`` unused), int8 (bits 8) or uint8 packed
    int4 (bits 4, ``[..., Hkv, D // 2]``, the layout of :mod:`kernels.quantize`); ``scale``
    ``[..., Hkv]`` float32. The int4 nibbles are sign-extended by arithmetic shifts on the int8
    view (low: ``(x << 4) >> 4``, high: ``x >> 4``), which on the CPU is about 4x cheaper than
    looking every byte up in a table (an int64 index tensor and a gather)."""
    if bits == 0:
        out.copy_(x)
        return
    # Converted, then scaled in place: an int8 x float32 ``torch.mul(..., out=)`` takes a slow
    # mixed-dtype path on the CPU (3.2x longer for INT8 at [4, 3840, 4, 32] on two cores; the
    # values are the same bit for bit).
    s = scale[..., None]
    if bits == 8:
        out.copy_(x)
        out.mul_(s)
        return
    x = x.view(torch.int8)
    pairs = out.unflatten(-1, (-1, 2))                                   # [..., Hkv, D // 2, 2]
    low, high = pairs[..., 0], pairs[..., 1]
    low.copy_(torch.bitwise_left_shift(x, 4).bitwise_right_shift_(4))
    low.mul_(s)
    high.copy_(torch.bitwise_right_shift(x, 4))
    high.mul_(s)


# The multi-pool CPU path gathers and dequantizes this many bytes of float32 keys and values at a
# time (a chunk of consecutive sequences), attends them, then reuses the buffer for the next chunk,
# so what SDPA reads back is still in the cache. Measured on this project's 2-core EPYC (32 MiB L3),
# batch 8, 3,840 tokens, 4 KV heads x 32, one layer, medians of 15 calls: one 31 MiB buffer for the
# whole batch 12.4 ms (full KV) / 4.8 ms (PASK's mix, 95 % INT8); 8 MiB chunks 2.7 / 2.3 ms;
# 16 MiB 4.6 / 3.3 ms; 1-4 MiB 2.8 ms.
POOLS_CHUNK_BYTES = 8 << 20


def paged_decode_attention_pools_ref(q, pools, extra_kv=None, sm_scale: float | None = None):
    """Decode attention over several pools at once (plain torch, for the CPU): for each chunk of
    consecutive sequences (:data:`POOLS_CHUNK_BYTES` of float32 keys and values), each pool's kept
    pages are gathered (``index_select`` over page ids) and dequantized straight into one reused
    float32 buffer laid out ``[c, Hkv, T, D]`` (rows of keys contiguous, which the fused SDPA
    kernel reads about twice as fast as a ``[c, T, Hkv, D]`` view), and the buffer is attended in
    one masked SDPA call, instead of one call per pool merged by log-sum-exp.

    Args:
        q: ``[B, Hq, D]``.
        pools: tuples ``(k, v, k_scale, v_scale, block_table, lens, bits)`` as in
            :func:`paged_decode_attention_ref`.
        extra_kv: optional ``(k [B, Hkv, D], v [B, Hkv, D], mask [B] bool)``: one more key per
            row where ``mask`` (a new token attending to itself at full precision).
    Returns ``[B, Hq, D]`` float32 (zeros for a row with no key).
    """
    b, hq, d = q.shape
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    parts = []
    for k, v, k_scale, v_scale, block_table, lens, bits in pools:
        _check(q, k, v, k_scale, v_scale, block_table, lens, bits)
        max_len = int(lens.max())
        if max_len:
            parts.append((k, v, k_scale, v_scale, block_table, lens, bits, max_len))
    total = sum(p[-1] for p in parts) + (extra_kv is not None)
    out = torch.zeros(b, hq, d, dtype=torch.float32, device=q.device)
    if not total:
        return out
    hkv = parts[0][0].shape[2] if parts else extra_kv[0].shape[1]
    qf = q.float()[:, :, None]                                           # [B, Hq, 1, D]
    size = max(1, min(b, POOLS_CHUNK_BYTES // (2 * hkv * total * d * 4)))
    for s0 in range(0, b, size):
        s1 = min(b, s0 + size)
        c = s1 - s0
        keys = _workspace("pools_k", (c, hkv, total, d), torch.float32, q.device)
        values = _workspace("pools_v", (c, hkv, total, d), torch.float32, q.device)
        mask = torch.empty(c, total, dtype=torch.bool, device=q.device)
        at = 0
        for k, v, k_scale, v_scale, block_table, lens, bits, max_len in parts:
            bs = k.shape[1]
            num_pages = -(-max_len // bs)
            pages = block_table[s0:s1, :num_pages].reshape(-1).long()
            for pool, scale, buf in ((k, k_scale, keys), (v, v_scale, values)):
                x = pool.index_select(0, pages).view(c, num_pages * bs, *pool.shape[2:])[:, :max_len]
                sx = None if not bits else scale.index_select(0, pages).view(c, num_pages * bs, hkv)[:, :max_len]
                _dequantize_into(x, sx, bits, buf[:, :, at:at + max_len].transpose(1, 2))
            mask[:, at:at + max_len] = (torch.arange(max_len, device=q.device)[None, :]
                                        < lens[s0:s1].to(q.device)[:, None])
            at += max_len
        if extra_kv is not None:
            ek, ev, emask = extra_kv
            keys[:, :, at] = ek[s0:s1]
            values[:, :, at] = ev[s0:s1]
            mask[:, at] = emask[s0:s1].to(q.device)
        o = F.scaled_dot_product_attention(qf[s0:s1], keys, values, attn_mask=mask[:, None, None, :],
                                           scale=sm_scale, enable_gqa=True)
        out[s0:s1] = o[:, :, 0]
    return out.nan_to_num_(0.0)


def merge_attention_states(outs, lses, return_lse: bool = False):
    """Merge partial attention results over disjoint key sets.

    Args:
        outs: N tensors ``[B, Hq, D]`` float32 (or one stacked ``[N, B, Hq, D]``).
        lses: their log-sum-exps, N tensors ``[B, Hq]`` (or ``[N, B, Hq]``).
    Returns ``[B, Hq, D]`` float32, and the merged ``[B, Hq]`` log-sum-exp when ``return_lse``
    (``-inf`` where every part is empty).
    """
    lse = lses if torch.is_tensor(lses) else torch.stack(lses)          # [N, B, Hq]
    out = outs if torch.is_tensor(outs) else torch.stack(outs)          # [N, B, Hq, D]
    top = lse.amax(dim=0)
    shift = torch.where(torch.isinf(top), 0.0, top)
    weights = torch.exp(lse - shift).nan_to_num(0.0)
    total = weights.sum(dim=0)
    merged = (weights[..., None] * out).sum(dim=0) / total.clamp_min(1e-30)[..., None]
    if not return_lse:
        return merged
    return merged, torch.where(total > 0, shift + torch.log(total.clamp_min(1e-30)), float("-inf"))


if triton is not None:
    @triton.jit
    def _load_kv(k_ptr, ks_ptr, offs, soffs, kvmask, tmask, BITS: tl.constexpr):
        """One block of keys (or values) as float32: (even / all dims, odd dims or zeros)."""
        if BITS == 0:
            a = tl.load(k_ptr + offs, mask=kvmask, other=0.0).to(tl.float32)
            return a, tl.zeros_like(a)
        scale = tl.load(ks_ptr + soffs, mask=tmask, other=0.0)
        if BITS == 8:
            a = tl.load(k_ptr + offs, mask=kvmask, other=0).to(tl.float32) * scale[:, None]
            return a, tl.zeros_like(a)
        packed = tl.load(k_ptr + offs, mask=kvmask, other=0).to(tl.int32)
        lo, hi = packed & 15, (packed >> 4) & 15
        a = tl.where(lo >= 8, lo - 16, lo).to(tl.float32) * scale[:, None]
        b = tl.where(hi >= 8, hi - 16, hi).to(tl.float32) * scale[:, None]
        return a, b

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr, DT: tl.constexpr):
        """``a @ b`` in float32: IEEE products, or ``DT`` (the query dtype) operands."""
        if IEEE:
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a.to(DT), b.to(DT))

    @triton.jit
    def _decode_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, out_ptr, lse_ptr,
                       sm_scale, stride_qb, stride_qh, stride_kp, stride_kt, stride_kh,
                       stride_sp, stride_st, stride_btb, stride_os, stride_ob, stride_oh,
                       stride_ls, pages_per_split,
                       G: tl.constexpr, G_PAD: tl.constexpr, DK: tl.constexpr, DK_PAD: tl.constexpr,
                       BS: tl.constexpr, BLOCK_N: tl.constexpr, BITS: tl.constexpr, IEEE: tl.constexpr):
        DT: tl.constexpr = q_ptr.dtype.element_ty
        b = tl.program_id(0)
        h = tl.program_id(1)
        split = tl.program_id(2)
        length = tl.load(lens_ptr + b)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, DK_PAD)
        gmask = g < G
        dmask = d < DK
        qmask = gmask[:, None] & dmask[None, :]
        q_row = q_ptr + b * stride_qb + (h * G + g)[:, None] * stride_qh
        # For int4 the head dimension is handled as even / odd halves (the two nibbles of a byte).
        if BITS == 4:
            q_a = tl.load(q_row + 2 * d[None, :], mask=qmask, other=0.0).to(tl.float32)
            q_b = tl.load(q_row + 2 * d[None, :] + 1, mask=qmask, other=0.0).to(tl.float32)
        else:
            q_a = tl.load(q_row + d[None, :], mask=qmask, other=0.0).to(tl.float32)
            q_b = tl.zeros([G_PAD, DK_PAD], dtype=tl.float32)
        m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([G_PAD], dtype=tl.float32)
        acc_a = tl.zeros([G_PAD, DK_PAD], dtype=tl.float32)
        acc_b = tl.zeros([G_PAD, DK_PAD], dtype=tl.float32)
        t = tl.arange(0, BLOCK_N)
        # This program's share of the sequence (split-KV, as in FlashDecoding), walked in blocks
        # of BLOCK_N tokens that span BLOCK_N / BS pages.
        first = split * pages_per_split * BS
        last = tl.minimum(length, first + pages_per_split * BS)
        for start in range(first, last, BLOCK_N):
            tok = start + t
            tmask = tok < last
            page = tl.load(bt_ptr + b * stride_btb + tok // BS, mask=tmask, other=0).to(tl.int64)
            slot = tok % BS
            kvmask = tmask[:, None] & dmask[None, :]
            offs = page[:, None] * stride_kp + slot[:, None] * stride_kt + h * stride_kh + d[None, :]
            soffs = page * stride_sp + slot * stride_st + h
            k_a, k_b = _load_kv(k_ptr, ks_ptr, offs, soffs, kvmask, tmask, BITS)
            v_a, v_b = _load_kv(v_ptr, vs_ptr, offs, soffs, kvmask, tmask, BITS)
            scores = _dot(q_a, tl.trans(k_a), IEEE, DT)
            if BITS == 4:
                scores += _dot(q_b, tl.trans(k_b), IEEE, DT)
            # Cast back: inside a compiled graph inductor passes a symbolic sm_scale as float64,
            # which made the loop-carried m_i float64, a Triton compile error (H200, 2026-12-04).
            scores = tl.where(tmask[None, :], (scores * sm_scale).to(tl.float32), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc_a = acc_a * alpha[:, None] + _dot(p, v_a, IEEE, DT)
            if BITS == 4:
                acc_b = acc_b * alpha[:, None] + _dot(p, v_b, IEEE, DT)
            m_i = m_new
        nonempty = l_i > 0
        denom = tl.where(nonempty, l_i, 1.0)
        out_row = out_ptr + split * stride_os + b * stride_ob + (h * G + g)[:, None] * stride_oh
        if BITS == 4:
            tl.store(out_row + 2 * d[None, :], acc_a / denom[:, None], mask=qmask)
            tl.store(out_row + 2 * d[None, :] + 1, acc_b / denom[:, None], mask=qmask)
        else:
            tl.store(out_row + d[None, :], acc_a / denom[:, None], mask=qmask)
        lse = tl.where(nonempty, m_i + tl.log(denom), float("-inf"))
        tl.store(lse_ptr + split * stride_ls + b * (G * tl.num_programs(1)) + h * G + g, lse, mask=gmask)


def default_num_splits(batch: int, kv_heads: int, max_pages: int, target_programs: int = 264,
                       min_pages: int = 1024) -> int:
    """Splits of each sequence's pages: none below ``min_pages`` pages per sequence, else enough
    for about ``target_programs`` programs (two per SM of an H200) with >= 256 pages each.

    Measured on an H200 (``bench.kernels``, docs/results/gpu_h200.md): at 512 pages (8k tokens)
    one program per (sequence, KV head) was faster even with 64 programs, the merge's fixed cost
    dominating; at 2,048 pages (32k tokens, batch 8) 5 splits were 2.7x faster than none.
    """
    if max_pages < min_pages:
        return 1
    return max(1, min(-(-target_programs // max(1, batch * kv_heads)), max_pages // 256))


def paged_decode_attention_triton(q, k, v, k_scale, v_scale, block_table, lens, bits: int,
                                  sm_scale: float | None = None, num_splits: int | None = None,
                                  need_lse: bool = True):
    """Triton version of :func:`paged_decode_attention_ref` (same contract).

    Each program attends the query group of one (sequence, KV head, split) to a contiguous range
    of the sequence's pages, 64 tokens (several pages) per block, with ``tl.dot`` on the query
    group padded to 16 rows (tensor cores; operands in ``q``'s dtype, IEEE float32 products when
    ``q`` is float32); with ``num_splits > 1`` (default :func:`default_num_splits` of the block table's width)
    the partial results are merged by their log-sum-exp, the split-KV scheme of FlashDecoding
    (Dao et al., 2023), so short batches of long sequences still fill the GPU.
    """
    _check(q, k, v, k_scale, v_scale, block_table, lens, bits)
    b, hq, d = q.shape
    _, bs, hkv, dk = k.shape
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    q = q.contiguous()
    max_pages = block_table.shape[1]
    splits = num_splits or default_num_splits(b, hkv, max_pages)
    splits = max(1, min(splits, max(1, max_pages)))
    per_split = max(1, -(-max_pages // splits))
    out = torch.zeros(splits, b, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(splits, b, hq, dtype=torch.float32, device=q.device)
    if b == 0:
        return out[0], lse[0]
    if k.stride(3) != 1:
        raise ValueError("pool head_dim must be contiguous")
    ks = k_scale if bits else k  # unused pointers when bits == 0
    vs = v_scale if bits else v
    _decode_kernel[(b, hkv, splits)](
        q, k, v, ks, vs, block_table, lens, out, lse, sm_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        ks.stride(0) if bits else 0, ks.stride(1) if bits else 0, block_table.stride(0),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), per_split,
        G=hq // hkv, G_PAD=max(16, triton.next_power_of_2(hq // hkv)), DK=dk,
        DK_PAD=max(16, triton.next_power_of_2(dk)), BS=bs,
        BLOCK_N=max(64, triton.next_power_of_2(bs)), BITS=bits,
        # The interpreter (TRITON_INTERPRET=1) computes bfloat16 dots wrongly: float32 there.
        IEEE=q.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1")
    if splits == 1:
        return out[0], lse[0]
    return merge_attention_states(out, lse, return_lse=True)
