"""How a replica is set up: where its API key comes from, and tensor parallelism under Ray (inside
a placement group with a bundle per rank the engine starts its worker ranks as Ray tasks on the
other bundles, with the tokens of one rank; the Serve deployment asks for that placement group)."""

import pytest

from cluster.app import AppArgs, replica_options
from replicas.sampling_params import SamplingParams


def test_replica_options_reserve_a_bundle_per_rank():
    assert "placement_group_bundles" not in replica_options(AppArgs(num_cpus=2))
    opts = replica_options(AppArgs(tensor_parallel_size=2, num_cpus=2, num_gpus=1))
    assert opts["placement_group_bundles"] == [{"CPU": 2, "GPU": 1}, {"CPU": 2, "GPU": 1}]
    assert opts["placement_group_strategy"] == "STRICT_PACK"
    assert opts["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 1}


@pytest.mark.slow
def test_tp_workers_run_as_ray_tasks_in_the_placement_group(ray_cluster, engine, chat_prompts):
    ray = ray_cluster
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [o.token_ids for o in engine.generate(chat_prompts[:2], params)]

    @ray.remote(num_cpus=0.25)
    class Replica:
        def run(self, prompts):
            from replicas import tp
            from replicas.config import EngineConfig
            from replicas.engine import LLMEngine
            eng = LLMEngine(EngineConfig(kv_cache_bytes=64 << 20, tensor_parallel_size=2))
            try:
                kinds = [type(w).__name__ for w in eng._workers]
                return (tp.current_placement_group(2) is not None, kinds,
                        [o.token_ids for o in eng.generate(prompts, params)])
            finally:
                eng.close()

    pg = placement_group([{"CPU": 0.25}, {"CPU": 0.25}], strategy="STRICT_PACK")
    try:
        ray.get(pg.ready(), timeout=60)
        replica = Replica.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=0)).remote()
        in_group, kinds, got = ray.get(replica.run.remote(chat_prompts[:2]), timeout=300)
        assert in_group and kinds == ["_RayWorker"]
        assert got == want
    finally:
        remove_placement_group(pg)


def test_api_key_sources(tmp_path, monkeypatch):
    from cluster.app import resolve_api_key
    monkeypatch.delenv("STRUCTKV_API_KEY", raising=False)
    assert resolve_api_key(AppArgs()) is None
    monkeypatch.setenv("STRUCTKV_API_KEY", "from-env")
    assert resolve_api_key(AppArgs()) == "from-env"
    f = tmp_path / "key"
    f.write_text("from-file\n")
    assert resolve_api_key(AppArgs(api_key_file=str(f))) == "from-file"
    assert resolve_api_key(AppArgs(api_key="literal", api_key_file=str(f))) == "literal"
    with pytest.raises(ValueError, match="missing or empty"):
        resolve_api_key(AppArgs(api_key_file=str(tmp_path / "nope")))


def test_prefix_caching_is_an_app_arg_refused_with_tensor_parallelism():
    from cluster.app import build_app
    assert AppArgs(enable_prefix_caching=True).enable_prefix_caching and not AppArgs().enable_prefix_caching
    with pytest.raises(ValueError, match="not supported with tensor_parallel_size > 1"):
        build_app({"kv_policy": "pask", "enable_prefix_caching": True, "tensor_parallel_size": 2})   # before any replica starts
