"""Kernels: Triton (under TRITON_INTERPRET=1 on the CPU) against the torch references, and the
references against float64 dense attention."""

import math
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton compiles anything

import kernels  # noqa: E402
from kernels import cpu_attention  # noqa: E402
from kernels import (dequantize_ref, merge_attention_states, paged_decode_attention_pools_ref,  # noqa: E402
                     paged_decode_attention_ref, quantize_ref, quantize_store_ref)

triton = pytest.importorskip("triton")
interpret = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                               reason="needs TRITON_INTERPRET=1 or CUDA")


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n,h,d", [(1, 1, 2), (7, 3, 10), (13, 2, 64)])
def test_quantize_roundtrip_error_bound(bits, n, h, d):
    x = torch.randn(n, h, d) * 3
    data, scale = quantize_ref(x, bits)
    err = (dequantize_ref(data, scale, bits) - x).abs()
    assert (err <= scale[..., None] * 0.5 + 1e-6).all()


@interpret
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n,h,d", [(1, 1, 2), (5, 3, 6), (9, 2, 32)])
def test_quantize_store_triton_matches_ref(bits, n, h, d):
    x = torch.randn(n, h, d)
    slots_total = 3 * n + 2
    dk = d if bits == 8 else d // 2
    dtype = torch.int8 if bits == 8 else torch.uint8
    pools = [(torch.zeros(slots_total, h, dk, dtype=dtype), torch.zeros(slots_total, h)) for _ in range(2)]
    slots = torch.randperm(slots_total)[:n]
    quantize_store_ref(x, *pools[0], slots, bits)
    kernels.quantize_store_triton(x, *pools[1], slots, bits)
    a = dequantize_ref(pools[0][0][slots], pools[0][1][slots], bits)
    b = dequantize_ref(pools[1][0][slots], pools[1][1][slots], bits)
    torch.testing.assert_close(pools[0][1], pools[1][1])
    # Rounding at exact .5 boundaries may differ by one step between division implementations.
    assert ((a - b).abs() <= pools[0][1][slots][..., None] * 1.001).all()
    assert (a == b).float().mean() > 0.98


def make_pool(lens, bs, hkv, d, bits, num_pages_extra=3):
    """Random pages holding lens[b] entries per sequence, scattered over a shuffled page pool."""
    pages_per = [max(1, math.ceil(n / bs)) for n in lens]
    num_pages = sum(pages_per) + num_pages_extra
    perm = torch.randperm(num_pages)
    table = torch.zeros(len(lens), max(pages_per), dtype=torch.int32)
    i = 0
    for b, p in enumerate(pages_per):
        table[b, :p] = perm[i:i + p].to(torch.int32)
        i += p
    kf, vf = torch.randn(num_pages, bs, hkv, d), torch.randn(num_pages, bs, hkv, d)
    if bits == 0:
        return table, (kf, vf, None, None), (kf.double(), vf.double())
    kq, ks = quantize_ref(kf.flatten(0, 1), bits)
    vq, vs = quantize_ref(vf.flatten(0, 1), bits)
    shape = (num_pages, bs)
    pool = (kq.view(*shape, *kq.shape[1:]), vq.view(*shape, *vq.shape[1:]), ks.view(*shape, hkv), vs.view(*shape, hkv))
    dense = (dequantize_ref(pool[0], pool[2], bits).double(), dequantize_ref(pool[1], pool[3], bits).double())
    return table, pool, dense


def dense_reference(q, dense_k, dense_v, table, lens, bs):
    """float64 attention per sequence over its first lens[b] slots."""
    b, hq, d = q.shape
    hkv = dense_k.shape[2]
    out = torch.zeros(b, hq, d, dtype=torch.float64)
    for i, n in enumerate(lens):
        if n == 0:
            continue
        keys = dense_k[table[i].long()].flatten(0, 1)[:n].repeat_interleave(hq // hkv, dim=1)
        vals = dense_v[table[i].long()].flatten(0, 1)[:n].repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("hd,thd->ht", q[i].double(), keys) / math.sqrt(d)
        out[i] = torch.einsum("ht,thd->hd", s.softmax(-1), vals)
    return out


CASES = [([5], 4, 1, 1, 8), ([1, 17, 0, 9], 4, 6, 3, 12), ([33, 2], 16, 8, 2, 32), ([6, 6, 6], 5, 6, 6, 16)]


@pytest.mark.parametrize("chunk_bytes", [None, 1, 6000])
@pytest.mark.parametrize("bits", [0, 8, 4])
@pytest.mark.parametrize("lens,bs,hq,hkv,d", CASES)
def test_reference_matches_float64_dense(bits, lens, bs, hq, hkv, d, chunk_bytes, monkeypatch):
    """Also with the batch split into chunks: one sequence each (1 byte), or two (6,000 bytes: [1, 17] and [0, 9] in the second case)."""
    if chunk_bytes is not None:
        monkeypatch.setattr(kernels.decode_attention, "GATHER_CHUNK_BYTES", chunk_bytes)
    table, pool, dense = make_pool(lens, bs, hkv, d, bits)
    q = torch.randn(len(lens), hq, d)
    out, lse = paged_decode_attention_ref(q, *pool, table, torch.tensor(lens, dtype=torch.int32), bits)
    want = dense_reference(q, *dense, table, lens, bs)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.isinf(lse[torch.tensor(lens) == 0]).all()


@interpret
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("bits", [0, 8, 4])
@pytest.mark.parametrize("lens,bs,hq,hkv,d", CASES)
def test_triton_decode_matches_reference(bits, lens, bs, hq, hkv, d, num_splits):
    """One program per (sequence, KV head), and split-KV (pages shared by 3 programs, merged by
    log-sum-exp; with fewer pages than splits some programs see no entries)."""
    table, pool, _ = make_pool(lens, bs, hkv, d, bits)
    q = torch.randn(len(lens), hq, d)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    ref_out, ref_lse = paged_decode_attention_ref(q, *pool, table, lens_t, bits)
    out, lse = kernels.paged_decode_attention_triton(q, *pool, table, lens_t, bits, num_splits=num_splits)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_merge_equals_attention_over_union():
    lens_a, lens_b = [4, 0, 7], [3, 5, 0]
    bs, hq, hkv, d = 4, 4, 2, 8
    ta, pa, da = make_pool(lens_a, bs, hkv, d, 0)
    tb, pb, db = make_pool(lens_b, bs, hkv, d, 8)
    q = torch.randn(3, hq, d)
    oa, la = paged_decode_attention_ref(q, *pa, ta, torch.tensor(lens_a, dtype=torch.int32), 0)
    ob, lb = paged_decode_attention_ref(q, *pb, tb, torch.tensor(lens_b, dtype=torch.int32), 8)
    merged, lse = merge_attention_states([oa, ob], [la, lb], return_lse=True)
    torch.testing.assert_close(lse, torch.logaddexp(la, lb))
    for i in range(3):
        keys = torch.cat([da[0][ta[i].long()].flatten(0, 1)[:lens_a[i]], db[0][tb[i].long()].flatten(0, 1)[:lens_b[i]]])
        vals = torch.cat([da[1][ta[i].long()].flatten(0, 1)[:lens_a[i]], db[1][tb[i].long()].flatten(0, 1)[:lens_b[i]]])
        keys, vals = keys.repeat_interleave(2, dim=1), vals.repeat_interleave(2, dim=1)
        s = torch.einsum("hd,thd->ht", q[i].double(), keys) / math.sqrt(d)
        torch.testing.assert_close(merged[i].double(), torch.einsum("ht,thd->hd", s.softmax(-1), vals),
                                   atol=1e-5, rtol=1e-5)


def _fused_cpu(q, pools, extra_kv=None, sm_scale=None):
    if not cpu_attention.available():
        pytest.fail("the fused CPU kernel did not build (is a C compiler installed?)")
    return cpu_attention.paged_decode_attention_pools_cpu(q, pools, extra_kv, sm_scale)


@pytest.mark.parametrize("impl,chunk_bytes,d", [("ref", None, 8), ("ref", 1, 8), ("fused", None, 8), ("fused", 1, 8),
                                                ("fused", None, 32), ("fused", 1, 64)])
@pytest.mark.parametrize("with_self", [False, True])
def test_pools_attention_equals_float64_attention_over_the_union(impl, with_self, chunk_bytes, d, monkeypatch,
                                                                  request):
    """HIGH, INT8 and INT4 pools (ragged, one row empty in a pool, one row empty everywhere but
    its own key) attended in one call equal dense float64 attention over every kept entry: the
    reference with the batch in one chunk and in chunks of one sequence (``chunk_bytes=1``), the
    fused C kernel with each row whole and cut into ranges of one entry (flash-decoding's split),
    at head sizes its vector path takes (multiples of 32) and one it does not (8)."""
    if impl == "ref" and chunk_bytes is not None:
        monkeypatch.setattr(kernels.decode_attention, "POOLS_CHUNK_BYTES", chunk_bytes)
    if impl == "fused" and chunk_bytes is not None:
        monkeypatch.setattr(cpu_attention, "MIN_SPLIT_ENTRIES", 1)
        threads = torch.get_num_threads()
        torch.set_num_threads(8)                                     # more ranges than rows
        request.addfinalizer(lambda: torch.set_num_threads(threads))
    attend = paged_decode_attention_pools_ref if impl == "ref" else _fused_cpu
    torch.manual_seed(1)
    bs, hkv = 4, 3
    hq = 9 if d == 32 else 6       # three query heads per KV head: the vector path's odd one out
    lens = {0: [5, 0, 3, 0], 8: [2, 9, 0, 0], 4: [7, 1, 4, 0]} if d == 8 else {0: [5, 0, 13, 0], 8: [21, 9, 0, 0], 4: [17, 1, 40, 0]}
    made = {bits: make_pool(n, bs, hkv, d, bits) for bits, n in lens.items()}
    q = torch.randn(4, hq, d)
    ek, ev = torch.randn(4, hkv, d), torch.randn(4, hkv, d)
    emask = torch.tensor([True, False, True, True]) if with_self else None
    pools = [(*pool, table, torch.tensor(lens[bits], dtype=torch.int32), bits)
             for bits, (table, pool, _) in made.items()]
    out = attend(q, pools, (ek, ev, emask) if with_self else None)
    for i in range(4):
        keys = [dense[0][table[i].long()].flatten(0, 1)[:lens[bits][i]] for bits, (table, _, dense) in made.items()]
        vals = [dense[1][table[i].long()].flatten(0, 1)[:lens[bits][i]] for bits, (table, _, dense) in made.items()]
        if with_self and emask[i]:
            keys, vals = keys + [ek[i:i + 1].double()], vals + [ev[i:i + 1].double()]
        keys, vals = torch.cat(keys), torch.cat(vals)
        if not len(keys):
            assert (out[i] == 0).all()
            continue
        keys, vals = keys.repeat_interleave(hq // hkv, dim=1), vals.repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("hd,thd->ht", q[i].double(), keys) / math.sqrt(d)
        torch.testing.assert_close(out[i].double(), torch.einsum("ht,thd->hd", s.softmax(-1), vals),
                                   atol=1e-5, rtol=1e-5)


def test_fused_cpu_kernel_serves_the_cpu_and_equals_the_reference(monkeypatch):
    """The registry runs the fused C kernel for CPU float32 inputs (not the reference), with the
    reference's results to float32 rounding; ``STRUCTKV_KERNELS=ref`` forces the reference."""
    torch.manual_seed(3)
    table, pool, _ = make_pool([40, 17, 0], 16, 2, 32, 8)
    q = torch.randn(3, 4, 32)
    pools = [(*pool, table, torch.tensor([40, 17, 0], dtype=torch.int32), 8)]
    calls = []
    real = cpu_attention.paged_decode_attention_pools_cpu
    monkeypatch.setattr(cpu_attention, "paged_decode_attention_pools_cpu", lambda *a: calls.append(1) or real(*a))
    out = kernels.paged_decode_attention_pools(q, pools)
    assert calls == [1]
    torch.testing.assert_close(out, paged_decode_attention_pools_ref(q, pools), atol=1e-6, rtol=1e-5)
    monkeypatch.setenv("STRUCTKV_KERNELS", "ref")
    kernels.paged_decode_attention_pools(q, pools)
    assert calls == [1]
    with pytest.raises(RuntimeError, match="float32"):
        real(q.double(), pools)
    with pytest.raises(RuntimeError, match="pool 0: block table must be contiguous int32"):
        real(q, [(*pool, table.long(), torch.tensor([40, 17, 0], dtype=torch.int32), 8)])


def test_fused_cpu_kernel_build_failure_names_the_compiler(monkeypatch, tmp_path):
    """A compiler that fails is reported with its command and output (the engine then logs it
    and keeps the reference), and nothing half-built is left in the cache."""
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setenv("STRUCTKV_CACHE_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="/bin/false .* failed"):
        cpu_attention._build()
    assert not list(tmp_path.glob("*.so"))


def test_registry_uses_reference_off_cuda():
    assert kernels.get_kernel("paged_decode_attention", torch.device("cpu")) is paged_decode_attention_ref
    with pytest.raises(ValueError, match="bits must be"):
        quantize_store_ref(torch.zeros(1, 1, 2), torch.zeros(1, 1, 2, dtype=torch.int8), torch.zeros(1, 1),
                           torch.zeros(1, dtype=torch.long), 5)


def test_reference_workspace_is_shared_in_and_outside_inference_mode():
    """The reference reuses one gather buffer; a buffer first made under inference mode must stay
    writable outside it (and the other way round), and results must not depend on the order."""
    table, pool, _ = make_pool([9, 3], 4, 2, 8, 0)
    q = torch.randn(2, 4, 8)
    lens = torch.tensor([9, 3], dtype=torch.int32)
    kernels.decode_attention._WORKSPACE.clear()
    with torch.inference_mode():
        a, _ = paged_decode_attention_ref(q, *pool, table, lens, 0)
    b, _ = paged_decode_attention_ref(q, *pool, table, lens, 0)
    torch.testing.assert_close(a, b)


def test_reference_without_lse_equals_with_lse():
    torch.manual_seed(0)
    bs, hkv, d = 4, 2, 8
    k, v = torch.randn(12, bs, hkv, d), torch.randn(12, bs, hkv, d)
    table = torch.randperm(12)[:9].view(3, 3).int()
    q = torch.randn(3, 4, d)
    for lens in ([9, 12, 5], [12, 12, 12], [0, 7, 12]):
        lens = torch.tensor(lens, dtype=torch.int32)
        out, lse = paged_decode_attention_ref(q, k, v, None, None, table, lens, 0)
        fast, none = paged_decode_attention_ref(q, k, v, None, None, table, lens, 0, need_lse=False)
        assert none is None
        torch.testing.assert_close(fast, out)
