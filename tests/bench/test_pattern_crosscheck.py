"""bench.pattern_crosscheck: random patterns through the server's grammars against the ECMA-262
reference, exhaustively over short strings."""

import random

from bench import pattern_crosscheck as pc
from bench.grammar_soundness import _compiler, validator


def test_random_patterns_are_deterministic_and_plain_ones_anchored():
    a = [pc.random_pattern(random.Random(7), plain=i % 2 == 1) for i in range(10)]
    b = [pc.random_pattern(random.Random(7), plain=i % 2 == 1) for i in range(10)]
    assert a == b
    rng = random.Random(1)
    plain = [pc.random_pattern(rng, plain=True) for _ in range(20)]
    assert all(p.startswith("^(?:") and p.endswith(")$") for p in plain)
    assert len(pc.all_strings(2)) == 1 + 5 + 25


def test_check_counts_wrong_verdicts_both_ways():
    class TakesAll:
        def accepts(self, text):
            return True
    v = validator({"type": "string", "pattern": "^a+$"})
    r = pc.check(TakesAll(), v, pc.all_strings(2))
    assert r["strings"] == 31 and r["valid_rejected"] == []
    assert "" in r["invalid_accepted"] and "a" not in r["invalid_accepted"]
    assert len(r["invalid_accepted"]) == 31 - 2   # all but "a" and "aa"


def test_server_grammars_agree_with_the_reference_on_a_few_patterns():
    """Patterns xgrammar 0.2.9 got wrong, now routed to llguidance, and a few plain ones: no
    invalid string accepted over every string of three characters or fewer."""
    tok, compiler = _compiler(10.0)
    strings = pc.all_strings(3)
    for p in ("^(?:0{1,2}|0)$", "^(?:a(\"0{1,2})?)$", "^(?:[a0]{2}\\d?)$", "^[^\"]+$", "a|0"):
        rec = pc.one(compiler, tok, p, strings, 60.0)
        assert rec["status"] == "served" and rec["strings"] == len(strings), rec
        assert rec["invalid_accepted"] == 0, rec
        assert rec["valid_rejected"] == rec["valid_rejected_control"], rec   # (tabs where classes leave them out)
