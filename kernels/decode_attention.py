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

import torch

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


def paged_decode_attention_ref(q, k, v, k_scale, v_scale, block_table, lens, bits: int,
                               sm_scale: float | None = None):
    """Plain-torch reference (gathers the pages, dequantizes, masked softmax)."""
    _check(q, k, v, k_scale, v_scale, block_table, lens, bits)
    b, hq, d = q.shape
    bs, hkv = k.shape[1], k.shape[2]
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    max_len = int(lens.max()) if b else 0
    out = torch.zeros(b, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, hq), float("-inf"), dtype=torch.float32, device=q.device)
    if max_len == 0:
        return out, lse
    num_pages = -(-max_len // bs)
    pages = block_table[:, :num_pages].long()

    def gather(pool, scale):
        x = pool[pages].flatten(1, 2)[:, :max_len]           # [B, T, Hkv, Dk]
        if bits:
            x = dequantize_ref(x, scale[pages].flatten(1, 2)[:, :max_len], bits)
        return x.float()

    keys, values = gather(k, k_scale), gather(v, v_scale)
    g = hq // hkv
    qg = q.float().view(b, hkv, g, d)
    scores = torch.einsum("bhgd,bthd->bhgt", qg, keys) * sm_scale
    valid = torch.arange(max_len, device=q.device)[None, :] < lens[:, None].to(q.device)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    row_lse = torch.logsumexp(scores, dim=-1)                  # [B, Hkv, G]
    probs = torch.exp(scores - row_lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhgt,bthd->bhgd", probs, values).reshape(b, hq, d)
    return out, row_lse.reshape(b, hq)


def merge_attention_states(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Merge partial attention results over disjoint key sets: ``[B, Hq, D]`` float32."""
    lse = torch.stack(lses)                                   # [N, B, Hq]
    top = lse.amax(dim=0)
    weights = torch.exp(lse - torch.where(torch.isinf(top), 0.0, top)).nan_to_num(0.0)
    total = weights.sum(dim=0).clamp_min(1e-30)
    return sum(w[..., None] * o for w, o in zip(weights, outs)) / total[..., None]


if triton is not None:
    @triton.jit
    def _decode_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, out_ptr, lse_ptr,
                       sm_scale, stride_qb, stride_qh, stride_kp, stride_kt, stride_kh,
                       stride_sp, stride_st, stride_btb, stride_ob, stride_oh,
                       G: tl.constexpr, G_PAD: tl.constexpr, DK: tl.constexpr, DK_PAD: tl.constexpr,
                       BS: tl.constexpr, BLOCK_N: tl.constexpr, BITS: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
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
        num_pages = tl.cdiv(length, BS)
        for i in range(0, num_pages):
            page = tl.load(bt_ptr + b * stride_btb + i).to(tl.int64)
            tmask = (t < BS) & (i * BS + t < length)
            kvmask = tmask[:, None] & dmask[None, :]
            offs = page * stride_kp + t[:, None] * stride_kt + h * stride_kh + d[None, :]
            if BITS == 0:
                k_a = tl.load(k_ptr + offs, mask=kvmask, other=0.0).to(tl.float32)
                v_a = tl.load(v_ptr + offs, mask=kvmask, other=0.0).to(tl.float32)
                k_b = tl.zeros([BLOCK_N, DK_PAD], dtype=tl.float32)
                v_b = tl.zeros([BLOCK_N, DK_PAD], dtype=tl.float32)
            else:
                soffs = page * stride_sp + t * stride_st + h
                ks = tl.load(ks_ptr + soffs, mask=tmask, other=0.0)
                vs = tl.load(vs_ptr + soffs, mask=tmask, other=0.0)
                if BITS == 8:
                    k_a = tl.load(k_ptr + offs, mask=kvmask, other=0).to(tl.float32) * ks[:, None]
                    v_a = tl.load(v_ptr + offs, mask=kvmask, other=0).to(tl.float32) * vs[:, None]
                    k_b = tl.zeros([BLOCK_N, DK_PAD], dtype=tl.float32)
                    v_b = tl.zeros([BLOCK_N, DK_PAD], dtype=tl.float32)
                else:
                    kp = tl.load(k_ptr + offs, mask=kvmask, other=0).to(tl.int32)
                    vp = tl.load(v_ptr + offs, mask=kvmask, other=0).to(tl.int32)
                    k_lo, k_hi = kp & 15, (kp >> 4) & 15
                    v_lo, v_hi = vp & 15, (vp >> 4) & 15
                    k_a = tl.where(k_lo >= 8, k_lo - 16, k_lo).to(tl.float32) * ks[:, None]
                    k_b = tl.where(k_hi >= 8, k_hi - 16, k_hi).to(tl.float32) * ks[:, None]
                    v_a = tl.where(v_lo >= 8, v_lo - 16, v_lo).to(tl.float32) * vs[:, None]
                    v_b = tl.where(v_hi >= 8, v_hi - 16, v_hi).to(tl.float32) * vs[:, None]
            scores = tl.sum(q_a[:, None, :] * k_a[None, :, :], axis=2)
            scores += tl.sum(q_b[:, None, :] * k_b[None, :, :], axis=2)
            scores = tl.where(tmask[None, :], scores * sm_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc_a = acc_a * alpha[:, None] + tl.sum(p[:, :, None] * v_a[None, :, :], axis=1)
            acc_b = acc_b * alpha[:, None] + tl.sum(p[:, :, None] * v_b[None, :, :], axis=1)
            m_i = m_new
        nonempty = l_i > 0
        denom = tl.where(nonempty, l_i, 1.0)
        out_row = out_ptr + b * stride_ob + (h * G + g)[:, None] * stride_oh
        if BITS == 4:
            tl.store(out_row + 2 * d[None, :], acc_a / denom[:, None], mask=qmask)
            tl.store(out_row + 2 * d[None, :] + 1, acc_b / denom[:, None], mask=qmask)
        else:
            tl.store(out_row + d[None, :], acc_a / denom[:, None], mask=qmask)
        lse = tl.where(nonempty, m_i + tl.log(denom), float("-inf"))
        tl.store(lse_ptr + b * (G * tl.num_programs(1)) + h * G + g, lse, mask=gmask)


def paged_decode_attention_triton(q, k, v, k_scale, v_scale, block_table, lens, bits: int,
                                  sm_scale: float | None = None):
    """Triton version of :func:`paged_decode_attention_ref` (same contract)."""
    _check(q, k, v, k_scale, v_scale, block_table, lens, bits)
    b, hq, d = q.shape
    _, bs, hkv, dk = k.shape
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    q = q.contiguous()
    out = torch.zeros(b, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, hq, dtype=torch.float32, device=q.device)
    if b == 0:
        return out, lse
    if k.stride(3) != 1:
        raise ValueError("pool head_dim must be contiguous")
    ks = k_scale if bits else k  # unused pointers when bits == 0
    vs = v_scale if bits else v
    _decode_kernel[(b, hkv)](
        q, k, v, ks, vs, block_table, lens, out, lse, sm_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        ks.stride(0) if bits else 0, ks.stride(1) if bits else 0, block_table.stride(0),
        out.stride(0), out.stride(1),
        G=hq // hkv, G_PAD=max(2, triton.next_power_of_2(hq // hkv)), DK=dk,
        DK_PAD=triton.next_power_of_2(dk), BS=bs,
        BLOCK_N=triton.next_power_of_2(bs), BITS=bits)
    return out, lse
