"""A running stream while another request's grammar compiles: inter-token latency, compile inline
(main's behaviour) against off the engine loop; and detokenizer decodes per token.

    python -m bench.compile_stall [--compile-s 5] [--tokens 600] [--repeats 2] [--json PATH]

One engine on the embedded model behind ``AsyncLLMEngine``, one asyncio loop (as the API server
runs it). A stream (a synthetic test prompt, ``--tokens`` generated, greedy) runs; in the compile
rows, once it has 50 tokens a second request arrives with a JSON schema not compiled before, whose
compile is made to take ``--compile-s`` seconds: ``GrammarCompiler.compile`` is wrapped to sleep
that long before compiling (a sleep releases the GIL, as the real compile does while it waits on
its compiler process; the compile itself is a real one of a small schema, a few ms). Rows:

- ``no compile``: the stream alone.
- ``inline``: ``AsyncLLMEngine(compile_inline=True)``: the compile runs in ``add_request`` under
  the engine lock, in the event loop's thread (main's code path).
- ``off loop``: this branch: the request is held while its grammar compiles in a thread.

ITL = time between two of the stream's outputs as its consumer sees them (ms), over the window
from the second request's arrival to its compile's end (``window``: for the no-compile row the
same number of seconds from its 50th token) and over the whole stream. Also the tokens the stream
got during the compile, the engine steps run in the window and the longest one (a gap about as
long as a step is the step itself, slowed by the shared CPU, not a wait), and where the longest
gap fell (seconds from the arrival). The rows run
in turn ``--repeats`` times, each compile row against the no-compile row just before it.

Detokenization (deterministic): the same requests through ``LLMEngine.generate`` with main's
detokenizer (tokenizer ``decode`` of the new ids with the previous step's as context, twice a
step, and a whole decode at the end) and this branch's (byte-level: each token's bytes looked up
and fed to an incremental UTF-8 decoder): ``decode`` calls and token ids decoded, per generated
token; and the token ids copied into outputs per request (main copied the whole list into every
output: the sum of ``num_output_tokens`` over outputs; now each token once as a delta and once in
the final output).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}


def _stats(gaps: list[float]) -> dict:
    if not gaps:
        return {"n": 0}
    s = sorted(gaps)
    p = lambda q: s[min(len(s) - 1, int(q * len(s)))]   # noqa: E731
    return {"n": len(s), "p50_ms": round(1e3 * statistics.median(s), 2), "p99_ms": round(1e3 * p(0.99), 2),
            "max_ms": round(1e3 * s[-1], 2)}


def stream_row(engine, mode: str, prompt: list[int], other: list[int], tokens: int, compile_s: float,
               tag: int) -> dict:
    from replicas.async_engine import AsyncLLMEngine
    from replicas.grammar import GrammarSpec
    from replicas.sampling_params import SamplingParams
    compiler = engine.grammar
    real = compiler.compile
    marks: dict[str, float] = {}

    def slow_compile(spec):
        marks["compile_start"] = time.perf_counter()
        time.sleep(compile_s)
        try:
            return real(spec)
        finally:
            marks["compile_end"] = time.perf_counter()
    compiler.compile = slow_compile
    steps: list[tuple[float, float]] = []   # (end, seconds) of every engine step

    def timed_step(step=engine.step):
        t = time.perf_counter()
        try:
            return step()
        finally:
            steps.append((time.perf_counter(), time.perf_counter() - t))
    engine.step = timed_step
    a = AsyncLLMEngine(engine, compile_inline=(mode == "inline"))

    async def constrained():
        spec = GrammarSpec("json_schema", {**SCHEMA, "title": f"compile-stall-{tag}"})   # not in the cache
        outs = [o async for o in a.generate(other, SamplingParams(max_tokens=32), grammar=spec)]
        return outs[-1]

    async def main():
        times, task = [], None
        async for out in a.generate(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True)):
            times.append(time.perf_counter())
            if out.num_output_tokens == 50:
                marks["arrival"] = time.perf_counter()
                if mode != "no compile":
                    task = asyncio.ensure_future(constrained())
                    await asyncio.sleep(0)   # the request starts (inline: blocks this loop in add_request)
        other_out = await task if task is not None else None
        return times, other_out

    try:
        times, other_out = asyncio.run(main())
    finally:
        a.shutdown()
        compiler.compile = real
        del engine.step
    start = marks["arrival"]
    end = marks.get("compile_end", start + compile_s)
    gaps = [(t1, t1 - t0) for t0, t1 in zip(times, times[1:])]
    window = [g for t1, g in gaps if start < t1 and t1 - g < end]
    during = sum(1 for t in times if start < t <= end)
    in_window = [d for t, d in steps if start < t and t - d < end]
    t1, g = max(gaps, key=lambda x: x[1])
    row = {"mode": mode, "window_s": round(end - start, 3), "tokens_during_compile": during,
           "longest_gap_s_from_arrival": [round(t1 - g - start, 3), round(t1 - start, 3)],
           "window": _stats(window), "engine_steps_in_window": len(in_window),
           "longest_step_in_window_ms": round(1e3 * max(in_window, default=0.0), 1), "whole": _stats([g for _, g in gaps]), "stream_tokens": len(times)}
    if other_out is not None:
        row["grammar_request"] = {"finish_reason": other_out.finish_reason, "text": other_out.text}
    return row


def decode_counts(engine, prompts: list[list[int]], tokens: int) -> dict:
    """Decode calls / token ids decoded per generated token, main's detokenizer vs this branch's."""
    from replicas.sampling_params import SamplingParams
    rows = {}
    saved_decode, saved_bytes = engine._detokenize, engine._token_bytes
    for name, byte_level in (("main", False), ("this branch", True)):
        count = {"decode_calls": 0, "ids_decoded": 0, "byte_table_builds": 0}

        def counted(ids, f=saved_decode):
            count["decode_calls"] += 1
            count["ids_decoded"] += len(ids)
            return f(ids)
        engine._detokenize = counted
        table = None
        if byte_level:   # a fresh table: its size is the number of ids whose bytes were built
            from replicas.detokenizer import TokenBytes
            table = TokenBytes(saved_bytes._backend, saved_bytes._byte_of)
        engine._token_bytes = table
        try:
            ids = [f"decode-{name}-{i}" for i in range(len(prompts))]
            for rid, p in zip(ids, prompts):
                engine.add_request(rid, p, SamplingParams(max_tokens=tokens, ignore_eos=True))
            copied = delta = 0
            final = {}
            while engine.has_unfinished():
                for out in engine.step():
                    copied += out.num_output_tokens          # what main's RequestOutput.of copied
                    delta += len(out.new_token_ids) + len(out.token_ids or ())
                    if out.finished:
                        final[out.request_id] = out
        finally:
            engine._detokenize, engine._token_bytes = saved_decode, saved_bytes
        n = sum(o.num_output_tokens for o in final.values())
        count["byte_table_builds"] = len(table) if table is not None else 0
        rows[name] = {"generated_tokens": n, "decode_calls_per_token": round(count["decode_calls"] / n, 3),
                      "ids_decoded_per_token": round(count["ids_decoded"] / n, 3),
                      "byte_table_builds": count["byte_table_builds"],
                      "texts": [final[r].text for r in ids]}
        if byte_level:
            rows[name]["ids_copied_into_outputs_per_request"] = delta / len(prompts)
        else:
            rows[name]["ids_copied_into_outputs_per_request"] = copied / len(prompts)
    rows["same_text"] = rows["main"].pop("texts") == rows["this branch"].pop("texts")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compile-s", type=float, default=5.0)
    ap.add_argument("--tokens", type=int, default=600, help="tokens the running stream generates")
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2, help="runs of the three rows, in turn")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    import torch

    from models import synth
    from replicas.config import EngineConfig
    from replicas.engine import LLMEngine
    from replicas.grammar import GrammarSpec
    torch.set_num_threads(1)
    engine = LLMEngine(EngineConfig(kv_cache_bytes=256 << 20, max_num_seqs=8))
    gen = synth.Generator("test", seed=7)
    prompts = [engine.tokenizer.apply_chat_template(ex.messages, tools=ex.tools, add_generation_prompt=True,
                                                    return_dict=True)["input_ids"]
               for cat in ("simple", "multiple") for ex in gen.examples(cat, 2)]
    engine.grammar.compile(GrammarSpec("json_schema", SCHEMA))   # the compiler process is up first
    rows = [stream_row(engine, mode, prompts[0], prompts[1], args.tokens, args.compile_s, i)
            for i, mode in enumerate(("no compile", "inline", "off loop") * args.repeats)]
    print(f"{'mode':<11} {'window s':>8} {'tok in it':>9} {'ITL p50':>8} {'p99':>8} {'max':>8} {'p99/base':>8}"
          f" {'max step':>8} | {'whole p50':>9} {'p99':>8} {'max':>8}")
    for k, r in enumerate(rows):
        w, h = r["window"], r["whole"]
        base = rows[k - k % 3]["window"]["p99_ms"]   # the no-compile row of the same run
        r["window_p99_over_no_compile"] = round(w["p99_ms"] / base, 2)
        print(f"{r['mode']:<11} {r['window_s']:>8.2f} {r['tokens_during_compile']:>9} {w['p50_ms']:>8.1f} "
              f"{w['p99_ms']:>8.1f} {w['max_ms']:>8.1f} {r['window_p99_over_no_compile']:>7.2f}x "
              f"{r['longest_step_in_window_ms']:>8.1f} | "
              f"{h['p50_ms']:>9.1f} {h['p99_ms']:>8.1f} {h['max_ms']:>8.1f}")
    counts = decode_counts(engine, prompts, args.decode_tokens)
    print(f"\ndetokenizer over {counts['main']['generated_tokens']} generated tokens "
          f"({len(prompts)} requests), same text: {counts['same_text']}")
    for name in ("main", "this branch"):
        c = counts[name]
        print(f"{name:<12} decode calls / token {c['decode_calls_per_token']:.3f}, ids decoded / token "
              f"{c['ids_decoded_per_token']:.3f}, byte-table builds {c['byte_table_builds']}, "
              f"ids copied into outputs / request {c['ids_copied_into_outputs_per_request']:.0f}")
    engine.close()
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                         "detokenizer": counts}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
