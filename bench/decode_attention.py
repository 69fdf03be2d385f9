"""One layer's decode attention on the CPU: the fused C kernel beside the torch reference.

    python -m bench.decode_attention [--batch 8] [--lens 437 3840] [--kv-heads 4] [--q-heads 8]
                                     [--head-dim 32] [--layers 6] [--threads 2] [--calls 15]

For each context length, two mixes of what a sequence keeps: full KV (every entry HIGH, float32)
and PASK's mix at 0.33 of full KV's bytes on the embedded model (5 % HIGH, 95 % INT8, as measured
in ``docs/results/throughput_policies.md``), each with the step's own token attended at full
precision. Pages are scattered over a shuffled pool (block size 16). Each timed call attends
``--layers`` layers in turn, each with its own pools, so the KV read is as large as a decode step's
(a single layer's pools stay in the cache between calls, which a step's do not). Prints the median
per layer over ``--calls`` calls of each implementation, their ratio, and the largest difference
of their outputs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kernels import cpu_attention
from kernels.decode_attention import paged_decode_attention_pools_ref
from kernels.quantize import quantize_ref


def make_pool(batch: int, tokens: int, kv_heads: int, head_dim: int, bits: int, block_size: int = 16,
              seed: int = 0):
    """A pool with ``tokens`` entries per row on shuffled pages: the tuple the kernels take."""
    g = torch.Generator().manual_seed(seed)
    pages = -(-tokens // block_size)
    total = batch * pages + 1
    k = torch.randn(total * block_size, kv_heads, head_dim, generator=g)
    v = torch.randn(total * block_size, kv_heads, head_dim, generator=g)
    ks = vs = None
    if bits:
        (k, ks), (v, vs) = quantize_ref(k, bits), quantize_ref(v, bits)
        ks, vs = ks.view(total, block_size, kv_heads), vs.view(total, block_size, kv_heads)
    k, v = k.view(total, block_size, kv_heads, -1), v.view(total, block_size, kv_heads, -1)
    table = torch.randperm(total, generator=g)[:batch * pages].view(batch, pages).to(torch.int32)
    return k, v, ks, vs, table, torch.full((batch,), tokens, dtype=torch.int32), bits


def median_ms(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lens", type=int, nargs="+", default=[437, 3840])
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--q-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=15)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not cpu_attention.available():
        raise SystemExit("the fused CPU kernel did not build: see the warning above")
    b, hq, hkv, d = args.batch, args.q_heads, args.kv_heads, args.head_dim
    print(f"batch {b}, {hq} query / {hkv} KV heads x {d}, {args.layers} layers, {args.threads} threads, "
          f"ms per layer (medians of {args.calls} calls)")
    print(f"{'tokens':>7} {'mix':<26} {'reference ms':>12} {'fused ms':>9} {'ref / fused':>11} {'max |diff|':>10}")
    for n in args.lens:
        high = max(1, n // 20)
        layers = range(args.layers)
        mixes = {"full KV (HIGH)": [[make_pool(b, n, hkv, d, 0, seed=3 * i)] for i in layers],
                 "PASK (5% HIGH, 95% INT8)": [[make_pool(b, high, hkv, d, 0, seed=3 * i + 1),
                                               make_pool(b, n - high, hkv, d, 8, seed=3 * i + 2)] for i in layers]}
        q = torch.randn(b, hq, d)
        extra = (torch.randn(b, hkv, d), torch.randn(b, hkv, d), torch.ones(b, dtype=torch.bool))
        for name, per_layer in mixes.items():
            def run(fn):
                for pools in per_layer:
                    fn(q, pools, extra)
            ref = median_ms(lambda: run(paged_decode_attention_pools_ref), args.calls) / args.layers
            fused = median_ms(lambda: run(cpu_attention.paged_decode_attention_pools_cpu), args.calls) / args.layers
            pools = per_layer[0]
            diff = (paged_decode_attention_pools_ref(q, pools, extra)
                    - cpu_attention.paged_decode_attention_pools_cpu(q, pools, extra)).abs().max().item()
            print(f"{n:>7} {name:<26} {ref:>12.2f} {fused:>9.2f} {ref / fused:>10.2f}x {diff:>10.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
