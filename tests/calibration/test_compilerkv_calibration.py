"""CompilerKV compilation: the bandit, and a reproducible run on a micro model."""

import random

import pytest
import torch

from calibration.compilerkv import (GATE_ARMS, WEIGHT_ARMS, Bandit, CompilerKVCalibrationConfig,
                                    CompilerKVWorker, compile_tables)


def test_bandit_prefers_the_best_arm_and_defaults_to_one():
    b = Bandit(WEIGHT_ARMS, epsilon=0.2)
    assert WEIGHT_ARMS[b.greedy(("x",))] == 1.0
    rng = random.Random(0)
    for _ in range(300):
        a = b.draw(("x",), rng)
        b.update(("x",), a, -abs(WEIGHT_ARMS[a] - 1.3) + rng.gauss(0, 0.01))
    assert WEIGHT_ARMS[b.greedy(("x",))] == 1.3


def _run(micro_model, out):
    from calibration.executors import LocalExecutor
    cfg = CompilerKVCalibrationConfig(str(micro_model), budgets=(64, 128), long_prompts=1, short_prompts=1,
                                      continuation_tokens=4, rounds=2, round_size=4, seed=3)
    args = (str(micro_model), 1, 1, 4, cfg.window, cfg.kernel)
    return compile_tables(cfg, out, LocalExecutor(lambda: CompilerKVWorker(*args)), progress=False)


@pytest.mark.slow
def test_micro_model_compilation_is_reproducible_and_loads(micro_model, tmp_path):
    from calibration.artifacts import ArtifactError, load_artifact
    from replicas.policies import CompilerKVTables
    a, b = _run(micro_model, tmp_path / "a"), _run(micro_model, tmp_path / "b")
    for name in a.tables:
        assert torch.equal(a.tables[name], b.tables[name]), name
    t = CompilerKVTables.from_tables(a.tables)
    assert t.head_weights.shape == (2, 2, 2) and t.gate.shape == (2, 2, 20, 4)
    assert all(min(abs(w - x) for x in WEIGHT_ARMS) < 1e-6 for w in t.head_weights.unique().tolist())
    assert all(min(abs(g - x) for x in GATE_ARMS) < 1e-6 for g in t.gate.unique().tolist())
    assert a.meta["estimator"]["rollouts"] == 8
    a.save(tmp_path / "a")
    load_artifact(tmp_path / "a", "compilerkv", micro_model)
    bad = dict(a.tables, gate=a.tables["gate"][:, :, :3])
    from calibration.artifacts import TableArtifact
    TableArtifact("compilerkv", bad, a.model_fingerprint, a.meta).save(tmp_path / "bad")
    with pytest.raises(ValueError, match="gate must be"):
        CompilerKVTables.from_tables(load_artifact(tmp_path / "bad", "compilerkv", micro_model).tables)
    (tmp_path / "a" / "tables.safetensors").write_bytes(b"garbage")
    with pytest.raises(ArtifactError, match="unreadable"):
        load_artifact(tmp_path / "a", "compilerkv")


def test_cli_refuses_bad_settings_before_any_work(tmp_path, capsys):
    """Found by a new-user pass: 0 prompts crashed in the quantile of an empty set (leaving a run
    folder that then refused the corrected command), 0 rounds wrote tables from no rollouts."""
    from calibration.compilerkv import main
    base = ["--model", "models/qwen3-fc-6m", "--out", str(tmp_path / "c"), "--executor", "local"]
    for extra, msg in ((["--kernel", "4"], "--kernel must be a positive odd width"),
                       (["--long-prompts", "0"], "--long-prompts must be in 1..25"),
                       (["--long-prompts", "26"], "--long-prompts must be in 1..25"),
                       (["--short-prompts", "-1"], "--short-prompts must be in 0..50"),
                       (["--rounds", "0"], "--rounds and --round-size must be at least 1")):
        with pytest.raises(SystemExit) as e:
            main(base + extra)
        assert e.value.code == 2 and msg in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
