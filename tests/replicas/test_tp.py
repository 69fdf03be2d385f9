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


@pytest.mark.slow
def test_two_ranks_pask_one_collective_per_step(chat_prompts):
    """PASK at a budget that makes it demote while decoding: the same tokens as one rank, and
    one broadcast per step (deferred KV mutations ride with the forward)."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    cfg = dict(kv_cache_bytes=64 << 20, kv_policy="pask", kv_budget=0.33)
    want = [o.token_ids for o in LLMEngine(EngineConfig(**cfg)).generate(chat_prompts[:3], params)]
    tp = LLMEngine(EngineConfig(**cfg, tensor_parallel_size=2))
    try:
        bcast = tp.kv._bcast
        ops = {"set_precision": 0, "plan_decode": 0}
        for name in ops:
            def counting(*args, _f=getattr(tp.kv._local, name), _name=name):
                ops[_name] += 1
                return _f(*args)
            setattr(tp.kv._local, name, counting)
        steps = 0
        for i, p in enumerate(chat_prompts[:3]):
            tp.add_request(f"r{i}", p, params)
        got = {}
        while tp.has_unfinished():
            steps += 1
            for out in tp.step():
                if out.finished:
                    got[out.request_id] = out.token_ids
        assert [got[f"r{i}"] for i in range(3)] == want
        assert ops["set_precision"] > 0 and sum(ops.values()) > steps   # more KV operations than steps ...
        assert bcast.num_sent == steps      # ... one collective each
    finally:
        tp.close()


@pytest.mark.slow
def test_two_ranks_jump_forward_takes_back_rejected_drafts():
    """Jump-forward with seeded sampling on two ranks: drafts the model rejects are taken back
    (``KVCache.truncate``, replayed on the worker with the next forward), and the tokens equal
    one rank's."""
    from bench.accuracy import load_items
    from replicas.grammar import GrammarSpec
    params = SamplingParams(max_tokens=32, temperature=1.0, seed=3)
    cfg = dict(kv_cache_bytes=64 << 20, enable_jump_forward=True)

    def run(eng):
        items = load_items("test", ["simple", "multiple"])[:2]
        for i, item in enumerate(items):
            ids = eng.tokenizer.apply_chat_template(item.messages, tools=item.tools, add_generation_prompt=True,
                                                    return_dict=True)["input_ids"]
            eng.add_request(f"r{i}", ids, params, GrammarSpec("tools", {"tools": item.tools, "tool_choice": "auto"}))
        outs = {}
        while eng.has_unfinished():
            for out in eng.step():
                if out.finished:
                    outs[out.request_id] = out
        return [outs[f"r{i}"] for i in range(len(items))]

    one = LLMEngine(EngineConfig(**cfg))
    want = run(one)
    one.close()
    assert sum(o.metrics.num_forced_tokens for o in want) < sum(o.metrics.num_draft_tokens for o in want)
    tp = LLMEngine(EngineConfig(**cfg, tensor_parallel_size=2))
    try:
        got = run(tp)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert tp.kv.bytes_used == 0
    finally:
        tp.close()
