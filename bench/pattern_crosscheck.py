"""JSON Schema ``pattern`` through the server's grammars, compared with the ECMA-262 reading.

    python -m bench.pattern_crosscheck random [--n 300] [--seed 0] [--max-len 4] [--json F]
    python -m bench.pattern_crosscheck jsonschemabench [--limit N] [--json F]

``random``: small random patterns (literals, ``.``, classes and class escapes, groups,
alternations, every quantifier, anchored and not) over a five-character alphabet that holds a
quote, a backslash and a tab (the characters JSON writes escaped); every string over that alphabet
up to ``--max-len`` characters is fed to the grammar the server compiles for
``{"type": "string", "pattern": P}`` (``GrammarCompiler.matcher``: the backend
``replicas.grammar.backend_for`` picks, its rewrites, the name and text checks) and its verdict
compared with the reference (:func:`bench.grammar_soundness.validator`: Python's ``re`` read as
ECMA-262). Exhaustive over short strings, so a wrong verdict is found wherever it shows within
that length.

With ``--negate`` each pattern is checked as ``{"type": "string", "not": {"pattern": P}}``: the
complement the server writes for llguidance (``replicas/regex_complement.py``), or its refusal.

``jsonschemabench``: every distinct ``pattern`` of JSONSchemaBench the same way, on strings drawn
from it (hypothesis ``from_regex``) and mutations of those (a character dropped, added, replaced;
a prefix).

Counts: patterns served per backend (and refused), strings checked, **invalid accepted** (the
grammar takes a string the pattern does not match: a soundness hole) and **valid rejected** (a
matching string the grammar cannot write, in the spelling tried: JSON's own escapes, other
characters raw; a raw U+007F is also tried escaped), of which with a control character (where
llguidance's classes leave them out on purpose: ``docs/grammar_backends.md``).

This found two xgrammar 0.2.9 pattern bugs the server now routes around
(``replicas.grammar.optional_group_with_repeated_end``, ``alternation_with_bounded_repeat``).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import itertools
import json
import os
import random
import re
import signal
import sys
import time
import warnings
from pathlib import Path

ALPHABET = 'a0"\\\t'
_QUANTIFIERS = ["", "", "", "?", "*", "+", "{1,2}", "{0,2}", "{2}", "{2,}", "??", "*?", "{0,1}"]
_ATOMS = ["a", "0", '"', "\\\\", "\\t", ".", "[a0]", "[^a]", '[^"]', "[^\\\\]", '[a"\\\\]', "[\\x00-\\x20]", "\\s",
          "\\S", "\\w", "\\W", "\\d", "\\D", "[\\s\\S]"]
_PLAIN_ATOMS = ["a", "0", "a", "0", "[a0]", "\\d", "\\w"]   # every other pattern: anchored, mostly xgrammar's


def random_pattern(rng: random.Random, plain: bool = False) -> str:
    """One small pattern: 1-2 alternatives of 1-3 atoms, groups nested at most twice; ``plain``:
    atoms without quotes, backslashes or whitespace (patterns the server mostly gives xgrammar)."""
    atoms = _PLAIN_ATOMS if plain else _ATOMS

    def atom(d):
        if d < 2 and rng.random() < 0.25:
            return "(" + alternatives(d + 1) + ")" + rng.choice(_QUANTIFIERS)
        return rng.choice(atoms) + rng.choice(_QUANTIFIERS)

    def alternatives(d):
        return "|".join("".join(atom(d) for _ in range(rng.randint(1, 3)))
                        for _ in range(1 if rng.random() < 0.7 else 2))
    body = alternatives(0)
    return f"^(?:{body})$" if plain or rng.random() < 0.6 else body


def all_strings(max_len: int) -> list[str]:
    return ["".join(t) for n in range(max_len + 1) for t in itertools.product(ALPHABET, repeat=n)]


def _texts(s: str) -> list[str]:
    """The JSON spellings tried for string ``s``."""
    text = json.dumps(s, ensure_ascii=False)
    return [text] + ([text.replace("\x7f", "\\u007f")] if "\x7f" in text else [])


def check(g, v, strings) -> dict:
    """Each string's verdict by grammar ``g`` against reference validator ``v``."""
    from bench.grammar_soundness import is_valid
    r = {"strings": 0, "invalid_accepted": [], "valid_rejected": []}
    for s in strings:
        want = is_valid(v, s)
        if want is None:
            continue
        r["strings"] += 1
        texts = _texts(s)
        got = any(g.accepts(t) for t in texts) if want else g.accepts(texts[0])
        if got and not want:
            r["invalid_accepted"].append(s)
        elif want and not got:
            r["valid_rejected"].append(s)
    return r


def one(compiler, tok, pattern: str, strings, seconds: float, negate: bool = False) -> dict:
    """The record of one pattern (status served / refused / bounded, backend, counts, examples);
    ``negate``: the schema ``{"type": "string", "not": {"pattern": P}}`` (the complement the
    server writes on automata, ``replicas/regex_complement.py``)."""
    from bench.grammar_soundness import Grammar, _alarm, _Timeout, validator
    from replicas.errors import GrammarCompileError
    schema = {"type": "string", "not": {"pattern": pattern}} if negate else {"type": "string", "pattern": pattern}
    rec = {"pattern": pattern}
    try:
        g = Grammar(compiler, tok, schema)
    except GrammarCompileError as e:
        return {**rec, "status": "refused", "reason": str(e)[:160]}
    try:
        v = validator(schema)
        v.is_valid("")
    except Exception as e:   # a pattern Python's re cannot read: no reference
        return {**rec, "status": "no reference", "backend": g.backend, "reason": str(e)[:160]}
    _alarm(seconds)
    status = "served"
    try:
        r = check(g, v, strings() if callable(strings) else strings)
    except _Timeout:
        status, r = "bounded", {"strings": 0, "invalid_accepted": [], "valid_rejected": []}
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
    control = sum(any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in s) for s in r["valid_rejected"])
    return {**rec, "status": status, "backend": g.backend, "strings": r["strings"],
            "invalid_accepted": len(r["invalid_accepted"]), "valid_rejected": len(r["valid_rejected"]),
            "valid_rejected_control": control,
            "examples": {"invalid accepted": r["invalid_accepted"][:4], "valid rejected": r["valid_rejected"][:4]}}


def bench_patterns(limit: int | None) -> list[str]:
    """The distinct ``pattern`` values of JSONSchemaBench, in file order."""
    from bench.grammar_coverage import JSONSCHEMABENCH_DIR
    from replicas.grammar import _walk
    seen: dict = {}
    for path in sorted(JSONSCHEMABENCH_DIR.glob("*.jsonl.gz")):
        with gzip.open(path, "rt") as f:
            for line in f:
                s = json.loads(line)["json_schema"]
                s = json.loads(s) if isinstance(s, str) else s
                if isinstance(s, dict):
                    for node, _ in _walk(s):
                        if isinstance(node.get("pattern"), str):
                            seen.setdefault(node["pattern"], None)
    return list(seen)[:limit] if limit else list(seen)


_POOL = 'a0.-_:/ Z9"\\\x01\u00e9'


def drawn_strings(pattern: str, n: int, seed: int) -> list[str]:
    """``n`` strings hypothesis draws from ``pattern`` (read as ECMA-262), each with six mutations."""
    from hypothesis import HealthCheck, given, settings, strategies as st

    from bench.grammar_soundness import _ecma
    try:
        rx = re.compile(_ecma(pattern), re.ASCII)
    except re.error:
        return []
    got: list = []

    @settings(max_examples=n, database=None, suppress_health_check=list(HealthCheck), deadline=None,
              derandomize=True)
    @given(st.from_regex(rx))
    def draw(x):
        got.append(x)
    try:
        draw()
    except Exception:   # (hypothesis gives up on some patterns: what was drawn is kept)
        pass
    rng, out = random.Random(seed), list(dict.fromkeys(got))
    for x in got:
        for _ in range(6):
            j, c = rng.randrange(len(x) + 1), rng.choice(_POOL)
            out.append(rng.choice([x[:j] + x[j + 1:], x[:j] + c + x[j:], x[:j] + c + x[j + 1:], x[:len(x) // 2]]))
    return list(dict.fromkeys(out))


def summarize(records: list[dict]) -> dict:
    c = collections.Counter()
    for r in records:
        c["patterns"] += 1
        c[r["status"]] += 1
        if r["status"] in ("served", "bounded"):
            c[r["backend"]] += 1
            for k in ("strings", "invalid_accepted", "valid_rejected"):
                c[k] += r.get(k, 0)
            c["patterns_invalid_accepted"] += r.get("invalid_accepted", 0) > 0
            c["patterns_valid_rejected"] += r.get("valid_rejected", 0) > 0
            c["valid_rejected_control"] += r.get("valid_rejected_control", 0)
    return dict(c)


def table(summary: dict) -> str:
    cols = ["patterns", "served", "xgrammar", "llguidance", "refused", "bounded", "strings", "invalid_accepted",
            "patterns_invalid_accepted", "valid_rejected", "valid_rejected_control", "patterns_valid_rejected"]
    return ("| " + " | ".join(c.replace("_", " ") for c in cols) + " |\n|" + "---:|" * len(cols) + "\n| "
            + " | ".join(f"{summary.get(c, 0):,}" for c in cols) + " |\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pattern_crosscheck", description=__doc__.split("\n\n")[0])
    ap.add_argument("source", choices=("random", "jsonschemabench"))
    ap.add_argument("--n", type=int, default=300, help="random patterns")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-len", type=int, default=4, help="random: every string up to this length")
    ap.add_argument("--limit", type=int, help="jsonschemabench: the first N distinct patterns")
    ap.add_argument("--draws", type=int, default=12, help="jsonschemabench: strings drawn per pattern")
    ap.add_argument("--pattern-s", type=float, default=30.0, help="CPU-time bound per pattern")
    ap.add_argument("--negate", action="store_true", help='each pattern as {"not": {"pattern": P}}')
    ap.add_argument("--json", type=Path, help="the summary and the records of patterns not served or with a wrong verdict")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    from bench.grammar_soundness import _compiler
    tok, compiler = _compiler(10.0)
    if a.source == "random":
        rng = random.Random(a.seed)
        patterns = list(dict.fromkeys(random_pattern(rng, plain=i % 2 == 1) for i in range(a.n)))
        strings = all_strings(a.max_len)
        source = lambda p, i: strings   # noqa: E731
    else:
        patterns = bench_patterns(a.limit)
        source = lambda p, i: (lambda: drawn_strings(p, a.draws, i))   # noqa: E731
    records, t0 = [], time.perf_counter()
    for i, p in enumerate(patterns):
        records.append(one(compiler, tok, p, source(p, i), a.pattern_s, negate=a.negate))
        r = records[-1]
        if r.get("invalid_accepted"):
            print(f"invalid accepted ({r['backend']}): {p!r}: {r['examples']['invalid accepted']}", flush=True)
    summary = summarize(records)
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    print(table(summary))
    examples = [r for r in records if r.get("valid_rejected")][:20]
    for r in examples:
        print(f"valid rejected ({r['backend']}): {r['pattern']!r}: {r['examples']['valid rejected']}")
    if a.json:
        kept = [r for r in records if r["status"] != "served" or r.get("invalid_accepted") or r.get("valid_rejected")]
        a.json.write_text(json.dumps({"args": vars(a) | {"json": str(a.json)}, "summary": summary,
                                      "records_with_a_wrong_verdict_or_not_served": kept},
                                     indent=1, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # A compile that passed its bound goes on in a thread xgrammar cannot stop; exiting normally
    # would wait for it (the whole-JSONSchemaBench run printed its table, then kept a core busy
    # for over an hour on one pattern's compile, stop 45).
    os._exit(code)
