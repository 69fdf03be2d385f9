"""The model's projections on the CPU: PyTorch's ``F.linear`` beside oneDNN-prepacked weights.

    python -m bench.linear_layout [--model PATH] [--batch 8] [--prompt-len 512] [--calls 50]
                                  [--repeats 7] [--kv-mib 24]

Two copies of one checkpoint: as loaded (every projection ``F.linear``, a BLAS GEMM over the
row-major weight) and after ``replicas.models.llama.prepack_linears`` (what the engine runs on the
CPU). For each, the forward without attention (the attention callable returns its queries, so
what is timed is projections, MLP, norms and RoPE) plus the logits:

- decode: ``--batch`` tokens, one per sequence, then ``--kv-mib`` MiB read, as a decode step's KV
  read pushes the weights out of the cache between two steps (0: weights stay cached);
- prefill: one prompt of ``--prompt-len`` tokens (logits of its last token only).

Runs alternate between the two copies (``--repeats`` rounds of ``--calls`` calls each); prints the
median ms per call of each, their ratio, and the largest difference of their logits.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _timed(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.linear_layout", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF checkpoint folder (default: the embedded model)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--kv-mib", type=float, default=24.0)
    args = ap.parse_args(argv)

    from models import resolve_checkpoint
    from replicas.models.llama import load_model, prepack_linears

    path = resolve_checkpoint(args.model)
    plain, packed = load_model(path), load_model(path)
    n = prepack_linears(packed)
    if not n:
        print("this PyTorch has no oneDNN: nothing to compare")
        return 1
    vocab = plain.config.vocab_size
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(int(args.kv_mib * 2**20) // 4 or 1, generator=g)
    decode_ids = torch.randint(0, vocab, (args.batch,), generator=g)
    decode_pos = torch.randint(args.prompt_len, 2 * args.prompt_len, (args.batch,), generator=g)
    prompt_ids = torch.randint(0, vocab, (args.prompt_len,), generator=g)
    prompt_pos = torch.arange(args.prompt_len)

    def no_attention(layer, q, k, v):
        return q

    def decode(model):
        def step():
            with torch.inference_mode():
                model.logits(model(decode_ids, decode_pos, no_attention))
                if args.kv_mib:
                    kv.sum()
        return step

    def prefill(model):
        def run():
            with torch.inference_mode():
                return model.logits(model(prompt_ids, prompt_pos, no_attention)[-1:])
        return run

    print(f"{path.name}: {n} projections prepacked, {torch.get_num_threads()} threads, "
          f"decode batch {args.batch} (+{args.kv_mib:g} MiB read a step), prefill {args.prompt_len} tokens")
    print(f"{'pass':<8} {'F.linear ms':>11} {'prepacked ms':>12} {'ratio':>6} {'max |logit diff|':>16}")
    with torch.inference_mode():
        diff_decode = (plain.logits(plain(decode_ids, decode_pos, no_attention))
                       - packed.logits(packed(decode_ids, decode_pos, no_attention))).abs().max().item()
    diff_prefill = (prefill(plain)() - prefill(packed)()).abs().max().item()
    for name, make, calls, diff in (("decode", decode, args.calls, diff_decode),
                                    ("prefill", prefill, max(1, args.calls // 10), diff_prefill)):
        fa, fb = make(plain), make(packed)
        fa(), fb()   # warm-up
        a, b = [], []
        for _ in range(args.repeats):
            a.append(_timed(fa, calls))
            b.append(_timed(fb, calls))
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"{name:<8} {ma:>11.2f} {mb:>12.2f} {ma / mb:>5.2f}x {diff:>16.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
