"""bench.token_overhead: the replay does the engine's per-token work and times each part."""

import pytest

from bench import token_overhead


def test_replay_times_every_part_and_rows_restart():
    r = token_overhead.measure("embedded", "tools", batch=2, steps=60, pool_size=2)
    assert r["steps"] == 60 and r["vocab_logits"] == 4096
    for part in token_overhead.PARTS:
        assert r[f"{part}_ms_per_step"] > 0
    assert r["host_ms_per_step"] == pytest.approx(r["total_ms_per_step"] - r["apply_ms_per_step"])


def test_replay_fails_on_a_token_the_grammar_rejects(monkeypatch):
    real = token_overhead.streams

    def broken(tokenizer, fmt, num, seed=0):   # answers that start with a token the grammar forbids
        bad = tokenizer("}", add_special_tokens=False)["input_ids"]
        return [(bad + ids, spec, args) for ids, spec, args in real(tokenizer, fmt, num, seed)]
    monkeypatch.setattr(token_overhead, "streams", broken)
    with pytest.raises(RuntimeError, match="rejected token"):
        token_overhead.measure("embedded", "json", batch=1, steps=2, pool_size=1)
