"""Cluster control: budget decisions (pure), the autoscaling decision (pure), and two replica
agents against the real controller and table registry actors on a local Ray cluster."""

import asyncio
import json

import pytest
import torch

from autoscale.budget import BudgetSettings, MemoryReading, ReplicaBudgetState, decide_budget
from autoscale.policy import decide_replicas
from cluster.memory import CPUReader, NVMLReader, ScriptedReader, make_reader

S = BudgetSettings(high_water=0.8, low_water=0.6, step_down=0.1, step_up=0.05, raise_after=2)


def run_script(fractions, floor=0.3, settings=S):
    state, out = ReplicaBudgetState(), []
    for f in fractions:
        state = decide_budget(state, MemoryReading(int(f * 100), 100, "scripted"), floor, settings)
        out.append(state.budget)
    return out


def direction_changes(budgets):
    steps = [b - a for a, b in zip(budgets, budgets[1:]) if b != a]
    return sum(1 for x, y in zip(steps, steps[1:]) if (x > 0) != (y > 0))


def test_budget_falls_above_high_water_never_below_floor_and_recovers():
    b = run_script([0.5, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.7, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5])
    assert b[0] == 1.0 and b[1] == pytest.approx(0.9) and min(b) == pytest.approx(0.3)  # floor
    assert b[9] == b[8]                              # inside the band: no change
    assert b[-1] > min(b) and direction_changes(b) == 1
    assert b[10] == b[9] and b[11] > b[10]           # a raise needs two low readings in a row


def test_no_oscillation_around_the_marks():
    wobble = [0.79, 0.81, 0.79, 0.81, 0.62, 0.58, 0.62, 0.58, 0.62, 0.58] * 4
    b = run_script(wobble)
    assert direction_changes(b) <= 1
    with pytest.raises(ValueError, match="low_water"):
        BudgetSettings(high_water=0.5, low_water=0.6)


def test_memory_readers():
    r = make_reader("scripted:[0.5, 0.9]")
    assert [r.read({}).fraction for _ in range(3)] == pytest.approx([0.5, 0.9, 0.9])
    with pytest.raises(ValueError, match="JSON list"):
        make_reader("scripted:[0.5,")
    with pytest.raises(ValueError, match="unknown memory reader"):
        make_reader("gpu")
    stats = {"kv_bytes_used": 25, "kv_bytes_max": 100}
    assert CPUReader().read(stats).fraction == 0.25
    nv = NVMLReader()                               # no driver here: falls back to the CPU reading
    reading = nv.read(stats)
    assert reading.source in ("nvml", "cpu")
    if nv.active_source == "cpu":
        assert reading.fraction == 0.25 and reading.process_rss_bytes > 0


def test_autoscaling_decision_over_scripted_metrics():
    state, n, trace = {}, 1, []
    load = [{"kv_pressure": {"a": 0.9}, "budget_at_floor": {"a": 1.0}, "queue_len": {"a": 6}, "budget": {"a": 0.3}}] * 2
    calm = [{"kv_pressure": {"a": 0.1, "b": 0.1}, "budget_at_floor": {"a": 0, "b": 0}, "queue_len": {"a": 0, "b": 0},
             "budget": {"a": 1.0, "b": 1.0}}] * 4
    for m in load + calm:
        n, state = decide_replicas(m, n, 1, 2, state)
        trace.append(n)
    assert trace == [2, 2, 2, 2, 1, 1]               # out under pressure (bounded by max), in after 3 calm
    busy_but_roomy = {"kv_pressure": {"a": 0.2}, "budget_at_floor": {"a": 0.0}, "queue_len": {"a": 9}, "budget": {"a": 1.0}}
    assert decide_replicas(busy_but_roomy, 1, 1, 4, {})[0] == 1   # queue alone is not KV pressure
    squeezed = dict(busy_but_roomy, budget={"a": 0.4}, kv_pressure={"a": 0.5})
    assert decide_replicas(squeezed, 1, 1, 4, {})[0] == 2          # the controller is trading quality for memory


def _table_artifact(folder, seed, corrupt=False, fingerprint=None):
    from calibration.artifacts import TableArtifact, model_fingerprint
    from models import EMBEDDED_MODEL_DIR
    import sys
    sys.path.insert(0, "tests/replicas")
    from test_pask_policy import graded_table
    torch.manual_seed(seed)
    TableArtifact("pask", graded_table().to_tables(), fingerprint or model_fingerprint(EMBEDDED_MODEL_DIR),
                  {"seed": seed}).save(folder)
    if corrupt:
        _corrupt(folder)
    return folder


def _corrupt(folder):
    m = json.loads((folder / "manifest.json").read_text())
    m["meta"]["seed"] = -1                          # edited after calibration: the hash no longer matches
    (folder / "manifest.json").write_text(json.dumps(m))


async def _ask(engine, prompt):
    from replicas.sampling_params import SamplingParams
    out = None
    async for out in engine.generate(prompt, SamplingParams(max_tokens=8), kv_budget=1.0):
        pass
    return out


@pytest.mark.ray
@pytest.mark.slow
def test_two_replicas_budgets_and_table_versions(ray_cluster, tmp_path, chat_prompts):
    ray = ray_cluster
    from cluster.agent import ReplicaAgent
    from cluster.control import get_controller, get_registry, publish_artifact
    from replicas.async_engine import AsyncLLMEngine
    from replicas.config import EngineConfig
    from replicas.engine import LLMEngine
    first = _table_artifact(tmp_path / "t1", 1)
    store = tmp_path / "store"
    controller = get_controller({"high_water": 0.8, "low_water": 0.6, "step_down": 0.1, "step_up": 0.05,
                                 "raise_after": 2})
    registry = get_registry(str(store))
    engines = [AsyncLLMEngine(LLMEngine(EngineConfig(kv_policy="pask", kv_policy_args={"table": str(first)},
                                                     kv_cache_bytes=32 << 20, max_num_seqs=4))) for _ in range(2)]
    hot = [0.5] + [0.95] * 10 + [0.5] * 12
    agents = [ReplicaAgent("r0", engines[0], ScriptedReader(hot), controller, registry, "pask"),
              ReplicaAgent("r1", engines[1], ScriptedReader([0.5]), controller, registry, "pask")]
    try:
        floor = engines[0].engine.floor_budget
        assert 0 < floor < 1
        budgets = [[], []]
        for _ in range(len(hot)):
            for i, a in enumerate(agents):
                budgets[i].append(a.tick()["budget"])
        assert min(budgets[0]) == pytest.approx(floor) and budgets[0][1] < 1.0, budgets  # fell, to the floor only
        assert budgets[0][-1] > min(budgets[0]) and direction_changes(budgets[0]) == 1
        assert budgets[1] == [1.0] * len(hot)                                      # the other replica untouched
        assert engines[0].engine.replica_budget == budgets[0][-1]
        # a new table version reaches both replicas; requests keep being served
        v2 = publish_artifact(_table_artifact(tmp_path / "t2", 2), "pask", version="v2")
        for a in agents:
            a.tick()
        assert [e.engine.table_versions.get("pask") for e in engines] == [v2, v2]
        assert asyncio.run(_ask(engines[0], chat_prompts[0])).finished
        # a corrupted artifact is refused at publication; one made for another model, or one
        # corrupted in the store after publication, is refused by both replicas, which keep v2
        from calibration.artifacts import ArtifactError
        with pytest.raises(ArtifactError, match="content hash"):
            publish_artifact(_table_artifact(tmp_path / "t3", 3, corrupt=True), "pask", version="v3")
        publish_artifact(_table_artifact(tmp_path / "t4", 4, fingerprint="0" * 64), "pask", version="v4-other-model")
        for a in agents:
            a.tick()
        assert [e.engine.table_versions["pask"] for e in engines] == ["v2", "v2"]
        v5 = publish_artifact(_table_artifact(tmp_path / "t5", 5), "pask", version="v5-rot")
        _corrupt(store / "pask" / v5)
        for a in agents:
            a.tick()
        assert [e.engine.table_versions["pask"] for e in engines] == ["v2", "v2"]
        refusals = ray.get(registry.get_refusals.remote())
        assert {(r["replica"], r["version"]) for r in refusals} == {
            (r, v) for r in ("r0", "r1") for v in ("v4-other-model", "v5-rot")}
        errors = " ".join(r["error"] for r in refusals)
        assert "calibrated for model" in errors and "content hash" in errors
        assert asyncio.run(_ask(engines[1], chat_prompts[1])).finished
        # rollback to a named version is one call; replicas follow
        v6 = publish_artifact(_table_artifact(tmp_path / "t6", 6), "pask", version="v6")
        for a in agents:
            a.tick()
        assert [e.engine.table_versions["pask"] for e in engines] == [v6, v6]
        ray.get(registry.rollback.remote("pask", "v2"))
        for a in agents:
            a.tick()
        assert [e.engine.table_versions["pask"] for e in engines] == ["v2", "v2"]
        with pytest.raises(ray.exceptions.RayTaskError, match="no pask table version"):
            ray.get(registry.rollback.remote("pask", "v99"))
        status = ray.get(controller.status.remote())
        assert set(status["replicas"]) == {"r0", "r1"} and status["decisions"]
    finally:
        for e in engines:
            e.shutdown()
        ray.kill(controller)
        ray.kill(registry)
