"""PASK calibration: floors, the nested candidate family, selection, and a whole run on a micro
model with the local and the Ray executor."""

import json

import pytest
import torch

from calibration.pask import (Calibrator, PASKCalibrationConfig, ProbeWorker, build_family,
                              family_costs, floors_from_probes, layer_groups)
from models import EMBEDDED_MODEL_DIR
from replicas.kv_cache import Precision

HIGH, INT8, INT4, REL = (int(p) for p in (Precision.HIGH, Precision.INT8, Precision.INT4, Precision.RELEASED))
COSTS = torch.tensor([0.0, 0.2, 0.3, 1.0], dtype=torch.float64)


def test_layer_groups_cover_all_layers():
    assert layer_groups(6, 3) == [(0, 2), (2, 4), (4, 6)]
    assert layer_groups(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert layer_groups(6, 6)[-1] == (5, 6) and layer_groups(6, 1) == [(0, 6)]
    with pytest.raises(ValueError, match="num_groups"):
        layer_groups(6, 7)


def test_floor_is_cheapest_passing_level_and_unobserved_cells_stay_high():
    observed = torch.tensor([[True, True], [True, False]])
    passed = {(0, 0, REL): True, (0, 1, REL): False, (0, 1, INT4): False, (0, 1, INT8): True,
              (1, 0, REL): False, (1, 0, INT4): False, (1, 0, INT8): False}
    floors = floors_from_probes(observed, passed)
    assert floors.tolist() == [[REL, INT8], [HIGH, HIGH]]


def test_family_is_nested_and_ordered_by_distortion_per_byte():
    floors = torch.tensor([[REL], [INT8], [HIGH]])
    dist = torch.zeros(3, 1, 4, dtype=torch.float64)
    dist[0, 0] = torch.tensor([1.0, 0.5, 0.4, 0.0])   # first step: 0.5 removed for 0.2 bytes x weight
    dist[1, 0] = torch.tensor([9.0, 9.0, 3.0, 0.0])   # 3.0 removed for 0.7 bytes x weight
    weights = torch.tensor([[0.5], [0.5], [0.0]])
    ups = build_family(floors, dist, weights, COSTS)
    assert ups[0] == (1, 0)                            # 3.0 / 0.35 > 0.5 / 0.1
    assert sorted(ups) == [(0, 0)] * 3 + [(1, 0)]      # every observed cell reaches HIGH, one step at a time
    costs = family_costs(floors, ups, torch.tensor([1, 1, 0]), torch.tensor([6]), COSTS)
    assert costs[0] == pytest.approx((0.0 + 0.3) / 2) and costs[-1] == pytest.approx(1.0)
    assert (costs[1:] >= costs[:-1] - 1e-12).all()
    rand = build_family(floors, dist, weights, COSTS, order="random", seed=3)
    assert sorted(rand) == sorted(ups) and rand == build_family(floors, dist, weights, COSTS, order="random", seed=3)


class FakeExecutor:
    """Accuracy falls with the KV kept for a 'critical' decode bucket (bucket 6), so floors,
    selection and ablations have something to find; no model runs."""
    width = 2

    def map(self, tasks):
        for i, t in enumerate(tasks):
            if t["kind"] == "distortion":
                yield i, {"distortion": (3 - t["level"]) * (5.0 if t["bucket"] == 6 else 0.1), "examples": 1}
                continue
            crit = min(t["decode"][6])
            right = {HIGH: 100, INT8: 99, INT4: 50, REL: 0}[crit]
            yield i, {"correct": [True] * right + [False] * (100 - right), "kv_ratio": 0.5}

    def close(self):
        pass


def test_calibrator_logic_with_a_fake_executor(tmp_path, monkeypatch):
    cfg = PASKCalibrationConfig(model=str(EMBEDDED_MODEL_DIR), num_groups=3, per_category=4, categories=("simple",))
    counts = {"decode": torch.tensor([0, 3, 9, 0, 2, 2, 4, 3, 0, 0, 5, 0, 2, 0, 0, 1]),
              "prompt": torch.tensor([20, 60, 0, 80, 40, 20, 5, 8, 3, 6])}
    monkeypatch.setattr(Calibrator, "_counts", lambda self, full: counts)
    art = Calibrator(cfg, tmp_path, FakeExecutor(), progress=False).run()
    floors = art.tables["decode_floors"]
    assert (floors[6] == INT8).all()                 # the critical bucket tolerates INT8 only
    assert (floors[[1, 2, 4, 5, 7, 10, 12, 15]] == REL).all()
    assert (floors[[0, 3, 8, 9, 11, 13, 14]] == HIGH).all()    # never observed
    ab = art.meta["sides"]["ablation"]
    assert ab["pask"]["budget"] <= ab["no_ranking"]["budget"] + 1e-9
    assert ab["pask"]["budget"] <= ab["no_floors"]["budget"] + 1e-9
    assert art.meta["sides"]["decode"]["selected"]["accuracy"] >= 0.95 * 1.0
    # a second run over the same folder reads every probe back
    assert json.loads((tmp_path / "settings.json").read_text())["num_groups"] == 3
    n = len((tmp_path / "probes.jsonl").read_text().splitlines())
    Calibrator(cfg, tmp_path, FakeExecutor(), progress=False).run()
    assert len((tmp_path / "probes.jsonl").read_text().splitlines()) == n
    with pytest.raises(ValueError, match="other settings"):
        Calibrator(PASKCalibrationConfig(model=str(EMBEDDED_MODEL_DIR), num_groups=2), tmp_path, FakeExecutor(), progress=False)


def _micro_run(micro_model, out, executor_kind, ray=None):
    from calibration.executors import LocalExecutor, RayExecutor
    cats = ["simple", "irrelevance"]
    cfg = PASKCalibrationConfig(str(micro_model), num_groups=2, per_category=2, categories=tuple(cats),
                                distortion_examples=2, max_new_tokens=6)
    args = (str(micro_model), cats, 2, 2, 6)
    ex = (LocalExecutor(lambda: ProbeWorker(*args)) if executor_kind == "local"
          else RayExecutor(ProbeWorker, args, num_workers=2, num_cpus=0.5))
    try:
        return Calibrator(cfg, out, ex, progress=False).run()
    finally:
        ex.close()


@pytest.mark.slow
@pytest.mark.ray
def test_micro_model_calibration_same_table_with_local_and_ray(micro_model, tmp_path, ray_cluster):
    from calibration.artifacts import load_artifact
    from replicas.policies import PASKTable
    local = _micro_run(micro_model, tmp_path / "local", "local")
    remote = _micro_run(micro_model, tmp_path / "ray", "ray")
    assert local.tables.keys() == remote.tables.keys()
    for name in local.tables:
        assert torch.equal(local.tables[name], remote.tables[name]), name
    local.save(tmp_path / "local")
    table = PASKTable.from_tables(load_artifact(tmp_path / "local", "pask", micro_model).tables)
    assert table.layer_groups == [(0, 1), (1, 2)]
    assert local.meta["sides"]["decode"]["counts"] == remote.meta["sides"]["decode"]["counts"]
    assert sum(local.meta["sides"]["prompt"]["counts"]) > 0
