"""bench.accuracy: the JSON it writes, and clear errors for bad input."""

import json

import pytest

from bench import accuracy


def test_runs_on_embedded_model_and_writes_json(tmp_path, capsys):
    path = tmp_path / "acc.json"
    assert accuracy.main(["--split", "test", "--category", "simple", "--category", "irrelevance",
                          "--limit", "2", "--json", str(path)]) == 0
    summary = json.loads(path.read_text())
    assert set(summary) >= {"policy", "budget", "split", "accuracy", "overall", "num_examples"}
    assert summary["kv_ratio_max"] == pytest.approx(1.0)
    assert summary["num_examples"] == {"simple": 2, "irrelevance": 2}
    assert all(0.0 <= v <= 1.0 for v in summary["accuracy"].values())
    assert "overall" in capsys.readouterr().out


def test_unknown_category(capsys):
    with pytest.raises(SystemExit) as e:
        accuracy.main(["--split", "test", "--category", "simple_python"])
    assert e.value.code == 2
    assert "unknown category 'simple_python'" in capsys.readouterr().err


def test_missing_checkpoint(tmp_path, capsys):
    assert accuracy.main(["--model", str(tmp_path / "nope"), "--limit", "1"]) == 2
    assert "model checkpoint not found" in capsys.readouterr().err


def test_corrupted_data_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "BFCL_v4_parallel.json").write_text('{"id": "parallel_0", "question": [[]]}\n{"id": \n')
    monkeypatch.setenv("BFCL_DIR", str(tmp_path))
    assert accuracy.main(["--split", "bfcl", "--category", "parallel"]) == 2
    assert "BFCL_v4_parallel.json:2: not valid JSON" in capsys.readouterr().err


def test_prefill_tokens_bad_combinations(capsys):
    for argv, msg in ((["--policy", "pask", "--prefill-tokens", "256"], "applies to"),
                      (["--policy", "snapkv", "--prefill-tokens", "0"], "at least 1"),
                      (["--policy", "snapkv", "--prefill-tokens", "256", "--budget", "0.5"], "leave --budget at 1.0"),
                      (["--backend", "hf", "--policy", "snapkv", "--budget", "0.5"], "runs full KV only")):
        with pytest.raises(SystemExit) as e:
            accuracy.main(argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err


def test_prefill_sweep_on_long_context(tmp_path, capsys):
    """A prefill-token sweep row per (policy, B), full KV once, the CompilerKV gate ablation as a
    policy name; the prompt is cut to B tokens per layer, so the achieved ratio is well below 1."""
    from bench import sweep
    assert sweep.main(["--prefill-tokens", "256", "--category", "long_context", "--limit", "1",
                       "--policies", "full", "snapkv", "compilerkv-no-gate", "--out", str(tmp_path),
                       "--name", "p", "--max-tokens", "8"]) == 0
    rows = json.loads((tmp_path / "p.json").read_text())
    assert [(r["policy"], r.get("prefill_tokens")) for r in rows] == [
        ("full", None), ("snapkv", 256), ("compilerkv-no-gate", 256)]
    for r in rows[1:]:
        # ~3,000-token prompts cut to 256 + generated tokens per layer
        assert r["kv_ratio_max"] < 0.25
    assert rows[0]["kv_ratio_max"] == pytest.approx(1.0)
    assert (tmp_path / "p.png").stat().st_size > 0 and "| prefill tokens |" in (tmp_path / "p.md").read_text()
    with pytest.raises(SystemExit):
        sweep.main(["--prefill-tokens", "256", "--policies", "pask"])
    assert "applies to" in capsys.readouterr().err
    # Found by a new-user pass: --limit 0 ran every prompt; --budgets beside --prefill-tokens was ignored.
    for argv, msg in ((["--limit", "0"], "--limit must be at least 1"),
                      (["--prefill-tokens", "256", "--budgets", "0.5"], "exclude each other")):
        with pytest.raises(SystemExit):
            sweep.main(argv)
        assert msg in capsys.readouterr().err


def test_sweep_skips_a_policy_that_refuses_the_budget(capsys):
    """Found in review: compilerkv refuses a total budget below 1 when the engine is built (a plain
    ValueError), which ended the whole default sweep and lost its rows."""
    from bench import sweep
    assert sweep.run(["compilerkv"], [0.5], "test", ["simple"], 1) == []
    assert "compilerkv budget 0.5" in capsys.readouterr().out
