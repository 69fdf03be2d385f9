"""PASK online policy: table states under a budget, floors, and per-token actions in the engine."""

import pytest
import torch

from replicas.grammar import GrammarSpec
from replicas.kv_cache import Precision
from replicas.policies import PASKPolicy, PASKTable
from replicas.sampling_params import SamplingParams
from replicas.tagger import BUCKETS, NUM_BUCKETS

P = {b: i for i, b in enumerate(BUCKETS)}


def table():
    floors = torch.full((NUM_BUCKETS, 2), int(Precision.HIGH), dtype=torch.int8)
    floors[P["punctuation"]] = int(Precision.RELEASED)
    floors[P["whitespace"], 1] = int(Precision.INT4)
    upgrades = torch.tensor([[P["punctuation"], 0], [P["punctuation"], 0], [P["whitespace"], 1]])
    return PASKTable(floors, upgrades, torch.tensor([0.4, 0.5, 0.6]), 0.3, [(0, 3), (3, 6)])


def test_budget_state_applies_upgrades_in_order_above_floors():
    t = table()
    assert t.upgrades_for_budget(0.2) == 0 and t.upgrades_for_budget(0.45) == 1 and t.upgrades_for_budget(1.0) == 3
    floors = t.actions_at(0)
    assert torch.equal(floors, t.floors)
    assert t.actions_at(2)[P["punctuation"], 0] == Precision.INT8
    for m in range(4):  # never below the floors, one step per upgrade
        assert (t.actions_at(m) >= t.floors).all()


def test_bad_tables_refused():
    t = table()
    with pytest.raises(ValueError, match="contiguous"):
        PASKTable(t.floors, t.upgrades, t.upgrade_costs, 0.3, [(0, 3), (4, 6)])
    with pytest.raises(ValueError, match="floors must be"):
        PASKTable(t.floors[:3], t.upgrades, t.upgrade_costs, 0.3, [(0, 3), (3, 6)])
    with pytest.raises(ValueError, match="calibrated table"):
        PASKPolicy()


def test_engine_applies_actions_per_token_and_layer_group(engine, chat_prompts):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]}}}]
    saved = engine.policy
    engine.policy = PASKPolicy(table())
    try:
        engine.add_request("pask", chat_prompts[0], SamplingParams(max_tokens=60),
                           GrammarSpec("tools", {"tools": tools, "tool_choice": "required"}), kv_budget=1.0)
        seq = engine._seqs["pask"]
        for _ in range(12):
            engine.step()
        tags = seq.policy_state["tags"]
        stored = [p for p in tags if p < seq.num_tokens - 1]  # tokens whose KV is in the cache
        assert any(tags[p] == P["punctuation"] for p in stored)
        for p in stored:
            low = engine.kv.kept("pask", 0).get(p)
            high = engine.kv.kept("pask", 5).get(p)
            # budget 1.0: all three upgrades applied on top of the floors
            if tags[p] == P["punctuation"]:
                assert low == Precision.INT8 and high is None
            elif tags[p] == P["whitespace"]:
                assert low == Precision.HIGH and high == Precision.INT8
            else:
                assert low == high == Precision.HIGH
        for p in range(len(chat_prompts[0])):
            assert engine.kv.kept("pask", 3)[p] == Precision.HIGH  # prompt untouched
    finally:
        engine.abort("pask")
        engine.policy = saved
