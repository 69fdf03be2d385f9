"""Table artifacts: round trip, and refusal of a corrupted table or another model."""

import json
import shutil

import pytest
import torch

from calibration.artifacts import ArtifactError, TableArtifact, load_artifact, model_fingerprint
from models import resolve_checkpoint


@pytest.fixture
def artifact():
    tables = {"actions": torch.tensor([[3, 2], [1, 0]], dtype=torch.int8), "scores": torch.rand(2, 2)}
    return TableArtifact("pask", tables, model_fingerprint(resolve_checkpoint()),
                         {"layer_groups": [[0, 3], [3, 6]], "build_command": "python -m calibration pask ..."})


def test_round_trip(tmp_path, artifact):
    artifact.save(tmp_path / "t")
    got = load_artifact(tmp_path / "t", "pask", resolve_checkpoint())
    assert got.content_hash() == artifact.content_hash()
    assert torch.equal(got.tables["actions"], artifact.tables["actions"]) and got.meta == artifact.meta


def test_corrupted_or_edited_refused(tmp_path, artifact):
    folder = artifact.save(tmp_path / "t")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["meta"]["layer_groups"] = [[0, 6]]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="content hash mismatch"):
        load_artifact(folder, "pask")
    (folder / "tables.safetensors").write_bytes(b"garbage")
    with pytest.raises(ArtifactError, match="unreadable"):
        load_artifact(folder, "pask")


def test_other_model_or_kind_refused(tmp_path, artifact):
    folder = artifact.save(tmp_path / "t")
    other = tmp_path / "model"
    shutil.copytree(resolve_checkpoint(), other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ArtifactError, match="calibrated for model"):
        load_artifact(folder, "pask", other)
    with pytest.raises(ArtifactError, match="expected 'compilerkv'"):
        load_artifact(folder, "compilerkv")
    with pytest.raises(ArtifactError, match="python -m calibration pask"):
        load_artifact(tmp_path / "missing", "pask")


def test_build_command_names_every_non_default_cli_setting():
    from calibration.artifacts import build_command
    from calibration.compilerkv import CLI_SETTINGS as CKV, CompilerKVCalibrationConfig
    from calibration.pask import CLI_SETTINGS as PASK, PASKCalibrationConfig
    base = "python -m calibration compilerkv --model M --out O"
    assert build_command("compilerkv", CompilerKVCalibrationConfig("m"), "M", "O", CKV) == base
    cfg = CompilerKVCalibrationConfig("m", budgets=(512,), long_prompts=24, rounds=24)
    assert build_command("compilerkv", cfg, "M", "O", CKV) == base + " --budgets 512 --long-prompts 24 --rounds 24"
    cfg = PASKCalibrationConfig("m", per_category=4, categories=("simple", "multiple"), alpha_decode=0.1)
    assert build_command("pask", cfg, "M", "O", PASK, {"categories": ","}) == (
        "python -m calibration pask --model M --out O --per-category 4 --categories simple,multiple --alpha-decode 0.1")
