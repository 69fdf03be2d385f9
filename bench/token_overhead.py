"""Host cost per generated token at a real vocabulary: grammar bitmask, structural tagger, detokenizer.

    nice -n 19 python -m bench.token_overhead [--vocabs embedded qwen3] [--batch 1 8 32]
        [--formats tools json] [--steps 96] [--grammar-backend xgrammar] [--itl-ms 86.3] [--json PATH]

No model runs: each batch row replays the reference answers of synthetic test examples
(``models.synth``, categories simple / multiple / parallel / parallel_multiple), tokenized by the
vocabulary, as if the model had generated them, and each decode step does the engine's per-token
host work on every row (``replicas/engine.py``):

- fill: xgrammar's batch bitmask fill (``GrammarCompiler.apply_bitmask``'s first half) and
  ``accept_token`` on each row's matcher; compilation is done before timing (the engine caches
  compiled grammars);
- apply: the bitmask applied to ``[batch, vocab]`` float32 logits on the CPU (its second half; on
  a GPU engine it runs on the device, so it is left out of "host");
- tagger: the token's text (``TokenText``, decoded once per id, warm) and PASK's
  ``StructuralTagger.feed`` + ``bucket_of``;
- detokenizer: ``IncrementalDetokenizer.add`` with the engine's decode function.

Formats: ``tools`` (the Qwen3 ``<tool_call>`` answer under the tools grammar, ``tool_choice``
auto) and ``json`` (the first call's arguments under its parameters schema, ``response_format``).
A row whose answer ends starts the next example with fresh state. Vocabularies: ``embedded``
(the 4,096-token tokenizer, 4,096 logits) and ``qwen3`` (``models.vocab``: 151,669 tokens, 151,936
logits as Qwen3's embedding). Reported per step (median over steps, ms) and per token (us = step
/ batch); "host" = fill + tagger + detokenizer, also as a share of each ``--itl-ms``
(inter-token latencies to compare with: pass the ones measured for the model and batch of interest).

Another grammar backend plugs in through ``GRAMMAR_BACKENDS`` (a class with the interface of
``XGrammarBackend``) and ``--grammar-backend``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

CATEGORIES = ("simple", "multiple", "parallel", "parallel_multiple")
VOCAB_SIZES = {"embedded": 4096, "qwen3": 151_936}   # logits per row (the model's embedding rows)
PARTS = ("fill", "apply", "tagger", "detokenizer")   # fill: bitmask fill + accept_token


class XGrammarBackend:
    """The engine's grammar path (``replicas.grammar.GrammarCompiler.apply_bitmask``) in its two
    halves: the bitmask fill (host, every device) and its application to the logits (on the
    logits' device: xgrammar's CPU kernel here; a GPU kernel when the logits are on CUDA)."""

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar as xgr

        from replicas.grammar import GrammarCompiler
        self.xgr, self.vocab_size = xgr, vocab_size
        self.compiler = GrammarCompiler(tokenizer, vocab_size, isolate=False)
        self._batch = xgr.BatchGrammarMatcher()
        self._bitmask = None

    def matcher(self, spec):
        """A fresh matcher for ``spec`` (a ``GrammarSpec``); compiles on first sight of the spec."""
        return self.compiler.matcher(spec)

    def fill(self, matchers):
        """The ``[B, ceil(vocab / 32)]`` int32 bitmask of the tokens each matcher allows."""
        if self._bitmask is None or self._bitmask.shape[0] < len(matchers):
            self._bitmask = self.xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        bitmask = self._bitmask[:len(matchers)]
        self._batch.batch_fill_next_token_bitmask([m.native for m in matchers], bitmask)   # replicas.grammar.Matcher s
        for i, m in enumerate(matchers):
            if hasattr(m, "restrict"):   # checks on the text (replicas/name_checks.py), as apply_bitmask runs them
                m.restrict(bitmask[i])
        return bitmask

    def apply(self, logits, bitmask) -> None:
        """Mask ``logits [B, vocab]`` (float32) in place."""
        self.xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device))

    def accept(self, matcher, token: int) -> bool:
        """Advance ``matcher`` by ``token``; False when the grammar rejects it."""
        return matcher.accept_token(token)

    def close(self) -> None:
        self.compiler.close()


GRAMMAR_BACKENDS = {"xgrammar": XGrammarBackend}


def load_tokenizer(vocab: str):
    from transformers import AutoTokenizer

    from models import EMBEDDED_MODEL_DIR
    from models.vocab import tokenizer_dir
    return AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR if vocab == "embedded" else tokenizer_dir(vocab))


def streams(tokenizer, fmt: str, num: int, seed: int = 0) -> list[tuple]:
    """``num`` replayable answers: (token ids, GrammarSpec, tagger arguments)."""
    from models import synth
    from models.chat import render_answer
    from replicas.grammar import GrammarSpec
    gen, out = synth.Generator("test", seed=seed), []
    for i in range(num):
        ex = gen.example(CATEGORIES[i % len(CATEGORIES)], i)
        if fmt == "tools":
            text, spec = render_answer(ex.answer), GrammarSpec("tools", {"tools": ex.tools, "tool_choice": "auto"})
            tagger_args = {"tools": ex.tools}
        else:
            call = ex.answer[0]
            schema = next(t["function"]["parameters"] for t in ex.tools if t["function"]["name"] == call["name"])
            text, spec = json.dumps(call["arguments"], ensure_ascii=False), GrammarSpec("json_schema", schema)
            tagger_args = {"json_schema": schema}
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        out.append((ids, spec, tagger_args))
    return out


class _Row:
    """One batch row replaying answers in turn, with the engine's per-request state."""

    def __init__(self, pool: list, start: int, backend, detokenize):
        self.pool, self.next, self.backend, self.detokenize = pool, start, backend, detokenize
        self._start()

    def _start(self):
        from replicas.detokenizer import IncrementalDetokenizer
        from replicas.tagger import StructuralTagger
        self.ids, spec, tagger_args = self.pool[self.next % len(self.pool)]
        self.next += 1
        self.pos = 0
        self.matcher = self.backend.matcher(spec)
        self.tagger = StructuralTagger(**tagger_args)
        self.detokenizer = IncrementalDetokenizer(self.detokenize)

    def token(self) -> int:
        return self.ids[self.pos]

    def advance(self):
        self.pos += 1
        if self.pos == len(self.ids):
            self._start()


def measure(vocab: str, fmt: str, batch: int, steps: int, backend_name: str = "xgrammar",
            tokenizer=None, pool_size: int = 8) -> dict:
    """Median per-step host time (ms) of each part at ``batch`` rows over ``steps`` decode steps,
    the rows replaying ``pool_size`` distinct answers."""
    import torch

    from replicas.engine import TokenText, _detokenizer
    from replicas.tagger import bucket_of
    tokenizer = tokenizer or load_tokenizer(vocab)
    backend = GRAMMAR_BACKENDS[backend_name](tokenizer, VOCAB_SIZES[vocab])
    pool = streams(tokenizer, fmt, num=pool_size)
    for _, spec, _ in pool:                     # compile before timing
        backend.matcher(spec)
    token_text, detokenize = TokenText(tokenizer), _detokenizer(tokenizer)
    for ids, _, _ in pool:                      # warm: the engine's TokenText lives as long as it does
        for t in ids:
            token_text[t]
    rows = [_Row(pool, i, backend, detokenize) for i in range(batch)]
    logits = torch.zeros(batch, VOCAB_SIZES[vocab])
    times = {part: [] for part in PARTS}
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            bitmask = backend.fill([r.matcher for r in rows])
            for r in rows:
                if not backend.accept(r.matcher, r.token()):
                    raise RuntimeError(f"the grammar rejected token {r.token()} of its own reference answer")
            t1 = time.perf_counter()
            backend.apply(logits, bitmask)
            t2 = time.perf_counter()
            for r in rows:
                bucket_of(r.tagger.feed(token_text[r.token()]))
            t3 = time.perf_counter()
            for r in rows:
                r.detokenizer.add(r.token())
            t4 = time.perf_counter()
            for r in rows:
                r.advance()
            for part, dt in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                times[part].append(dt)
    finally:
        backend.close()
    out = {"vocab": vocab, "vocab_logits": VOCAB_SIZES[vocab], "format": fmt, "batch": batch, "steps": steps,
           "grammar_backend": backend_name}
    for part, ts in times.items():
        out[f"{part}_ms_per_step"] = 1e3 * statistics.median(ts)
    out["total_ms_per_step"] = sum(out[f"{p}_ms_per_step"] for p in times)
    out["host_ms_per_step"] = out["total_ms_per_step"] - out["apply_ms_per_step"]   # what a GPU engine's host pays
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.token_overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocabs", nargs="+", default=["embedded", "qwen3"], choices=sorted(VOCAB_SIZES))
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--formats", nargs="+", default=["tools", "json"], choices=["tools", "json"])
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--grammar-backend", default="xgrammar", choices=sorted(GRAMMAR_BACKENDS))
    ap.add_argument("--itl-ms", nargs="*", type=float, default=[],
                    help="inter-token latencies (ms) to express the total as a share of")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.steps < 1 or min(args.batch) < 1:
        ap.error("--steps and --batch must be >= 1")
    rows = []
    shares = "".join(f" {'host % ' + format(itl, 'g') + 'ms':>13}" for itl in args.itl_ms)
    print(f"{'vocab':<9} {'format':<6} {'batch':>5} | ms per step: {'fill':>6} {'apply':>7} {'tagger':>7} "
          f"{'detok':>6} {'total':>7} | us per token: {'fill':>6} {'apply':>7} {'tagger':>7} {'detok':>6} "
          f"{'host':>6}{shares}")
    for vocab in args.vocabs:
        tokenizer = load_tokenizer(vocab)
        for fmt in args.formats:
            for b in args.batch:
                r = measure(vocab, fmt, b, args.steps, args.grammar_backend, tokenizer)
                rows.append(r)
                ms = [r[f"{p}_ms_per_step"] for p in PARTS]
                line = "".join(f" {100 * r['host_ms_per_step'] / itl:>12.2f}%" for itl in args.itl_ms)
                print(f"{vocab:<9} {fmt:<6} {b:>5} | {'':>12} {ms[0]:>6.3f} {ms[1]:>7.3f} {ms[2]:>7.3f} "
                      f"{ms[3]:>6.3f} {r['total_ms_per_step']:>7.3f} | {'':>13} "
                      + " ".join(f"{1e3 * m / b:>{w}.1f}" for m, w in zip(ms, (6, 7, 7, 6)))
                      + f" {1e3 * r['host_ms_per_step'] / b:>6.1f}{line}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "itl_ms": args.itl_ms}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
