"""The KV-cache kernels at Qwen3-4B shapes: Triton beside the torch reference and dense SDPA.

    python -m bench.kernels [--device cuda] [--quick] [--json PATH]

Decode attention over one pool (32 query heads, 8 KV heads, head_dim 128, 16-token pages scattered
over a shuffled pool) for batch x context cases and HIGH (bf16) / INT8 / INT4 pools:
- ``triton``: the paged kernel with its default split-KV; ``triton-1``: one program per
  (sequence, KV head), no split; ``ref``: the plain-torch reference (gathers pages, dequantizes);
- ``sdpa``: PyTorch's fused attention over the same keys stored densely ([B, Hkv, T, D], bf16),
  a bound on what paging costs, not a paged implementation.
Each row: median time (``triton.testing.do_bench`` on CUDA, wall clock elsewhere), bytes of the
pool read per call / time (GB/s), and the largest absolute difference from the reference output.
Quantize-and-store: tokens x 8 KV heads x 128 into an INT8 / INT4 pool; its "max err" column is the
fraction of stored bytes that differ from the reference's (rounding at exact .5 boundaries).
Prefill attention (one sequence, causal SDPA): GQA mode against expanded KV heads; its "max err"
column is the peak GPU memory in MiB.
On the CPU the Triton rows need ``TRITON_INTERPRET=1`` and ``--quick`` (tiny cases).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HQ, HKV, D, BS = 32, 8, 128, 16


def _timer(device):
    if device.type == "cuda":
        from triton.testing import do_bench
        return lambda fn: do_bench(fn, warmup=25, rep=100) / 1000.0

    def wall(fn, n=3):
        fn()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    return wall


def make_pool(batch: int, ctx: int, bits: int, device, dtype=torch.bfloat16, seed: int = 0):
    """A shuffled paged pool holding ``ctx`` tokens for each of ``batch`` sequences.

    Returns (pool tensors (k, v, k_scale, v_scale), block_table [B, pages] int32, lens [B] int32,
    dense k, v [B, Hkv, T, D] in ``dtype`` (dequantized for INT8 / INT4))."""
    from kernels import dequantize_ref, quantize_ref
    g = torch.Generator(device=device).manual_seed(seed)
    pages = -(-ctx // BS)
    total = batch * pages
    perm = torch.randperm(total, generator=g, device=device)
    table = perm.view(batch, pages).to(torch.int32)
    k = torch.randn(total, BS, HKV, D, generator=g, device=device)
    v = torch.randn(total, BS, HKV, D, generator=g, device=device)
    if bits == 0:
        pool = (k.to(dtype), v.to(dtype), None, None)
        kd, vd = pool[0], pool[1]
    else:
        kq, ks = quantize_ref(k.flatten(0, 1), bits)
        vq, vs = quantize_ref(v.flatten(0, 1), bits)
        shape = (total, BS)
        pool = (kq.view(*shape, *kq.shape[1:]), vq.view(*shape, *vq.shape[1:]), ks.view(*shape, HKV),
                vs.view(*shape, HKV))
        kd, vd = dequantize_ref(pool[0], pool[2], bits, dtype), dequantize_ref(pool[1], pool[3], bits, dtype)
    order = table.long()
    dense_k = kd[order].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
    dense_v = vd[order].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return pool, table, lens, dense_k, dense_v


def pool_bytes(pool, batch: int, ctx: int) -> int:
    k, _, ks, _ = pool
    per_token = 2 * HKV * k.shape[-1] * k.element_size() + (2 * HKV * 4 if ks is not None else 0)
    return batch * ctx * per_token


def decode_rows(cases, device, timer) -> list[dict]:
    from kernels import paged_decode_attention_ref, paged_decode_attention_triton
    from kernels.decode_attention import default_num_splits
    rows = []
    for batch, ctx in cases:
        for bits in (0, 8, 4):
            pool, table, lens, dk, dv = make_pool(batch, ctx, bits, device)
            q = torch.randn(batch, HQ, D, device=device, dtype=torch.bfloat16)
            nbytes = pool_bytes(pool, batch, ctx)
            ref_out, _ = paged_decode_attention_ref(q, *pool, table, lens, bits)
            impls = {
                "triton": lambda: paged_decode_attention_triton(q, *pool, table, lens, bits),
                "triton-1": lambda: paged_decode_attention_triton(q, *pool, table, lens, bits, num_splits=1),
                "ref": lambda: paged_decode_attention_ref(q, *pool, table, lens, bits),
                "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
                    q[:, :, None], dk, dv, enable_gqa=True),
            }
            for name, fn in impls.items():
                try:
                    out = fn()
                    out = out[0] if isinstance(out, tuple) else out[:, :, 0]
                    err = (out.float() - ref_out).abs().max().item()
                    t = timer(fn)
                except Exception as e:  # noqa: BLE001 - report the failing implementation, keep going
                    rows.append({"op": "decode", "batch": batch, "ctx": ctx, "bits": bits, "impl": name,
                                 "error": f"{type(e).__name__}: {e}"})
                    continue
                rows.append({"op": "decode", "batch": batch, "ctx": ctx, "bits": bits, "impl": name,
                             "ms": 1000 * t, "gb_s": nbytes / t / 1e9, "max_abs_err": err,
                             "splits": default_num_splits(batch, HKV, table.shape[1]) if name == "triton" else None})
            pool = dk = dv = None  # free before the next case
    return rows


def quantize_rows(token_counts, device, timer) -> list[dict]:
    from kernels import quantize_store_ref, quantize_store_triton
    rows = []
    for n in token_counts:
        x = torch.randn(n, HKV, D, device=device, dtype=torch.bfloat16)
        slots = torch.randperm(2 * n, device=device)[:n]
        for bits in (8, 4):
            dk = D if bits == 8 else D // 2
            dt = torch.int8 if bits == 8 else torch.uint8
            pools = {name: (torch.zeros(2 * n, HKV, dk, dtype=dt, device=device),
                            torch.zeros(2 * n, HKV, device=device)) for name in ("triton", "ref")}
            fns = {"triton": lambda: quantize_store_triton(x, *pools["triton"], slots, bits),
                   "ref": lambda: quantize_store_ref(x, *pools["ref"], slots, bits)}
            times = {name: timer(fn) for name, fn in fns.items()}
            a, b = pools["triton"], pools["ref"]
            differ = (a[0][slots] != b[0][slots]).float().mean().item()
            for name, t in times.items():
                rows.append({"op": "quantize_store", "tokens": n, "bits": bits, "impl": name, "ms": 1000 * t,
                             "gb_s": x.numel() * x.element_size() / t / 1e9,
                             "bytes_differing_frac": differ if name == "triton" else 0.0})
    return rows


def prefill_rows(lengths, device, timer) -> list[dict]:
    """Causal SDPA over one sequence at Qwen3-4B heads: GQA mode (``enable_gqa=True``) against KV
    heads expanded to the query heads (what ``replicas.model_runner.causal_attention`` does on CUDA)."""
    import torch.nn.functional as F
    rows = []
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for t in lengths:
        q = torch.randn(1, HQ, t, D, device=device, dtype=dtype)
        k, v = (torch.randn(1, HKV, t, D, device=device, dtype=dtype) for _ in range(2))
        fns = {"sdpa-gqa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
               "sdpa-expanded": lambda: F.scaled_dot_product_attention(
                   q, k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1), is_causal=True)}
        for name, fn in fns.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            t_s = timer(fn)
            peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
            rows.append({"op": "prefill_attention", "batch": 1, "bits": 16, "impl": name, "ms": 1000 * t_s, "ctx": t,
                         "gb_s": 3 * q.numel() * q.element_size() / t_s / 1e9, "peak_mib": peak and peak / 2**20})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny cases (the CPU interpreter)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    timer = _timer(device)
    cases = [(1, 64), (2, 100)] if args.quick else [(1, 4096), (8, 2048), (8, 8192), (32, 8192), (8, 32768)]
    tokens = [64] if args.quick else [2048, 65536]
    rows = (decode_rows(cases, device, timer) + quantize_rows(tokens, device, timer)
            + prefill_rows([256] if args.quick else [2048, 8192], device, timer))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\nkernels on {name}, Qwen3-4B attention shapes (Hq {HQ}, Hkv {HKV}, D {D}, page {BS})")
    print(f"{'op':<15}{'batch':>6}{'ctx':>7}{'bits':>5} {'impl':<9}{'ms':>9}{'GB/s':>9}{'max err':>10}{'splits':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['op']:<15}{r.get('batch', r.get('tokens')):>6}{r.get('ctx', '-'):>7}{r['bits']:>5} "
                  f"{r['impl']:<9} ERROR {r['error']}")
            continue
        err = r.get("max_abs_err", r.get("bytes_differing_frac", r.get("peak_mib"))) or 0.0
        print(f"{r['op']:<15}{r.get('batch', r.get('tokens')):>6}{r.get('ctx', '-'):>7}{r['bits']:>5} "
              f"{r['impl']:<9}{r['ms']:>9.3f}{r['gb_s']:>9.1f}{err:>10.2e}{r.get('splits') or '':>7}")
    print("\nratios (decode): ref / triton time, triton / sdpa time, triton-1 / triton time")
    for batch, ctx in cases:
        for bits in (0, 8, 4):
            t = {r["impl"]: r["ms"] for r in rows if r["op"] == "decode" and r["batch"] == batch
                 and r["ctx"] == ctx and r["bits"] == bits and "ms" in r}
            if {"triton", "ref", "sdpa", "triton-1"} <= t.keys():
                print(f"  B {batch:>2} ctx {ctx:>6} bits {bits}: ref/triton {t['ref'] / t['triton']:6.2f}x, "
                      f"triton/sdpa {t['triton'] / t['sdpa']:5.2f}x, no-split/split {t['triton-1'] / t['triton']:5.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"device": name, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
