"""Tensor parallelism: 2 ranks on CPU (gloo) give the same greedy tokens as 1 rank."""

import pytest

from replicas.config import EngineConfig
from replicas.engine import LLMEngine
from replicas.sampling_params import SamplingParams


@pytest.mark.slow
def test_two_ranks_match_one(engine, chat_prompts):
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = [o.token_ids for o in engine.generate(chat_prompts[:3], params)]
    tp = LLMEngine(EngineConfig(kv_cache_bytes=64 << 20, tensor_parallel_size=2))
    try:
        assert tp.kv.cfg.num_kv_heads == engine.kv.cfg.num_kv_heads // 2
        got = [o.token_ids for o in tp.generate(chat_prompts[:3], params)]
        assert got == want
        assert tp.kv.bytes_used == 0
    finally:
        tp.close()


def test_indivisible_heads_refused():
    from replicas.tp import shard_model
    from replicas.models import load_model
    from models import resolve_checkpoint
    model = load_model(resolve_checkpoint())
    with pytest.raises(ValueError, match="must divide num_kv_heads"):
        shard_model(model, 0, 3)
