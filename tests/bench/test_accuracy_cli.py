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
