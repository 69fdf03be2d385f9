"""PASK online policy: table states, floors, budget state, and per-token actions in the engine."""

import pytest
import torch

from replicas.errors import InvalidRequestError
from replicas.grammar import GrammarSpec
from replicas.kv_cache import Precision
from replicas.policies import PASKPolicy, PASKTable
from replicas.policies.pask import SideTable
from replicas.prompt_labels import NUM_PROMPT_BUCKETS, PROMPT_BUCKETS
from replicas.sampling_params import SamplingParams
from replicas.tagger import BUCKETS, NUM_BUCKETS

P = {b: i for i, b in enumerate(BUCKETS)}
Q = {b: i for i, b in enumerate(PROMPT_BUCKETS)}
HIGH, INT8, INT4, REL = (int(p) for p in (Precision.HIGH, Precision.INT8, Precision.INT4, Precision.RELEASED))
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]}}}]


def small_table():
    floors = torch.full((NUM_BUCKETS, 2), HIGH)
    floors[P["punctuation"]] = REL
    floors[P["whitespace"], 1] = INT4
    upgrades = torch.tensor([[P["punctuation"], 0], [P["punctuation"], 0], [P["whitespace"], 1]])
    prompt = torch.full((NUM_PROMPT_BUCKETS, 2), HIGH)
    prompt[Q["description"], 1] = REL
    return PASKTable(SideTable(floors, upgrades, torch.tensor([0.3, 0.4, 0.5, 0.6])),
                     SideTable(prompt, torch.empty(0, 2), torch.zeros(1)), [(0, 3), (3, 6)])


def graded_table(groups=((0, 2), (2, 4), (4, 6))):
    """Floors at INT4 / RELEASE for most cells, HIGH for the critical ones; upgrades to HIGH."""
    from calibration.pask import build_family, family_costs
    from replicas.kv_cache import KVCache, KVCacheConfig
    from replicas.policies.pask import level_costs
    g = len(groups)
    sizes = torch.tensor([b - a for a, b in groups])
    costs = level_costs(KVCache(KVCacheConfig(num_layers=6, num_kv_heads=4, head_dim=32, dtype=torch.float32,
                                              max_bytes=1 << 20)))
    sides = []
    for n, critical in ((NUM_BUCKETS, [P["function_name"], P["enum_value"]]), (NUM_PROMPT_BUCKETS, [Q["tool_name"]])):
        floors = torch.full((n, g), INT4)
        floors[::3] = REL
        floors[critical] = HIGH
        dist = torch.rand(n, g, 4, generator=torch.Generator().manual_seed(n)).sort(-1, descending=True).values
        dist[..., 3] = 0
        weights = torch.ones(n, g) / (n * g)
        ups = build_family(floors, dist, weights, costs)
        sides.append(SideTable(floors, torch.tensor(ups).reshape(-1, 2),
                               family_costs(floors, ups, torch.ones(n), sizes, costs)))
    return PASKTable(sides[0], sides[1], list(groups))


def test_budget_state_applies_upgrades_in_order_above_floors():
    t = small_table().decode
    assert t.state_for(0.2) == 0 and t.state_for(0.45) == 1 and t.state_for(1.0) == 3
    assert torch.equal(t.actions_at(0), t.floors)
    assert t.actions_at(2)[P["punctuation"], 0] == INT8
    for k in range(4):  # never below the floors, one step per upgrade
        assert (t.actions_at(k) >= t.floors).all()
        if k:
            assert int((t.actions_at(k) - t.actions_at(k - 1)).sum()) == 1


def test_bad_tables_refused():
    t = small_table()
    with pytest.raises(ValueError, match="contiguous"):
        PASKTable(t.decode, t.prompt, [(0, 3), (4, 6)])
    with pytest.raises(ValueError, match="floors must be"):
        PASKTable(SideTable(t.decode.floors[:3], torch.empty(0, 2), torch.zeros(1)), t.prompt, [(0, 3), (3, 6)])
    with pytest.raises(ValueError, match="already HIGH"):
        SideTable(t.decode.floors, torch.tensor([[P["function_name"], 0]]), torch.zeros(2))
    with pytest.raises(ValueError, match="U \\+ 1"):
        SideTable(t.decode.floors, torch.tensor([[P["punctuation"], 0]]), torch.zeros(1))


def test_artifact_round_trip_and_wrong_model_refused(tmp_path):
    from calibration.artifacts import ArtifactError, TableArtifact, model_fingerprint
    from models import EMBEDDED_MODEL_DIR
    t = graded_table()
    TableArtifact("pask", t.to_tables(), model_fingerprint(EMBEDDED_MODEL_DIR)).save(tmp_path / "pask")
    loaded = PASKTable.load(tmp_path / "pask", EMBEDDED_MODEL_DIR)
    assert torch.equal(loaded.decode.actions_at(5), t.decode.actions_at(5)) and loaded.layer_groups == t.layer_groups
    TableArtifact("pask", t.to_tables(), "0" * 64).save(tmp_path / "other")
    with pytest.raises(ArtifactError, match="calibrated for model"):
        PASKPolicy(str(tmp_path / "other")).bind_model(EMBEDDED_MODEL_DIR)


def _run(engine, policy, prompt, budget, rid, max_tokens=40, check=None):
    saved = engine.policy
    engine.policy = policy
    try:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens),
                           GrammarSpec("tools", {"tools": TOOLS, "tool_choice": "required"}), kv_budget=budget)
        seq = engine._seqs[rid]
        while not seq.is_finished:
            engine.step()
            if check and not seq.is_finished:
                check(seq)
        return seq
    finally:
        engine.abort(rid)
        engine.policy = saved


def test_engine_applies_actions_per_token_and_layer_group(engine, chat_prompts):
    prompt = chat_prompts[0]
    seen = {}

    def check(seq):
        tags = seq.policy_state["tags"]
        for p in [p for p in tags if p < seq.num_tokens - 1]:  # tokens whose KV is in the cache
            low, high = engine.kv.kept(seq.request_id, 0).get(p), engine.kv.kept(seq.request_id, 5).get(p)
            seen[tags[p]] = True
            # budget 1.0: all three upgrades applied on top of the floors
            if tags[p] == P["punctuation"]:
                assert low == Precision.INT8 and high is None
            elif tags[p] == P["whitespace"]:
                assert low == Precision.HIGH and high == Precision.INT8
            else:
                assert low == high == Precision.HIGH
        labels = seq.policy_state["prompt_labels"]
        for p in range(len(prompt)):
            expect_high = labels[p] != Q["description"]
            assert (engine.kv.kept(seq.request_id, 4).get(p) == Precision.HIGH) == expect_high
            assert engine.kv.kept(seq.request_id, 1)[p] == Precision.HIGH

    _run(engine, PASKPolicy(small_table()), prompt, 1.0, "pask-actions", max_tokens=16, check=check)
    assert P["punctuation"] in seen


@pytest.mark.parametrize("budget", [0.3, 0.45, 0.7])
def test_budget_state_holds_budget_and_floors(engine, chat_prompts, budget):
    table = graded_table()
    group = table.group_of_layer()
    steps = []

    def check(seq):
        kv, rid = engine.kv, seq.request_id
        assert kv.sequence_bytes(rid) <= budget * kv.full_kv_bytes(seq.num_tokens) + 1e-6
        prompt_len = len(seq.prompt_token_ids)
        labels, tags = seq.policy_state["prompt_labels"], seq.policy_state["tags"]
        for layer in range(6):
            kept = kv.kept(rid, layer)
            for p in range(seq.num_tokens - 1):
                floor = table.prompt.floors[labels[p]] if p < prompt_len else table.decode.floors[tags[p]]
                assert int(kept.get(p, Precision.RELEASED)) >= int(floor[group[layer]]), (layer, p)
        steps.append(list(seq.policy_state["pask_k"]))

    seq = _run(engine, PASKPolicy(table), chat_prompts[2], budget, f"pask-{budget}", check=check)
    assert seq.metrics.budget_fallbacks == 0 and len(steps) > 5
    assert seq.metrics.kv_ratio_max <= budget + 1e-6


def test_budget_below_floors_refused_and_lower_budget_demotes(engine, chat_prompts):
    table = graded_table()
    with pytest.raises(InvalidRequestError, match="floors keep"):
        _run(engine, PASKPolicy(table), chat_prompts[1], 0.05, "pask-low")
    hi = _run(engine, PASKPolicy(table), chat_prompts[1], 0.9, "pask-hi", max_tokens=8)
    lo = _run(engine, PASKPolicy(table), chat_prompts[1], 0.3, "pask-lo", max_tokens=8)
    assert lo.policy_state["pask_k"][0] < hi.policy_state["pask_k"][0]


def test_shipped_table_is_the_default_and_holds_a_budget(chat_prompts):
    from replicas.config import EngineConfig
    from replicas.engine import LLMEngine
    eng = LLMEngine(EngineConfig(kv_policy="pask", kv_budget=0.33, kv_cache_bytes=64 << 20))
    assert eng.policy.table.layer_groups == [(0, 2), (2, 4), (4, 6)] and 0 < eng.floor_budget < 0.33
    outs = eng.generate(chat_prompts[:3], SamplingParams(max_tokens=24),
                        [GrammarSpec("tools", {"tools": TOOLS, "tool_choice": "auto"})] * 3)
    for o in outs:
        assert o.metrics.kv_ratio_max <= 0.33 and o.metrics.budget_fallbacks == 0


def test_budget_changes_under_a_full_pool_never_fail_a_step():
    """Demotions need LOW pages; on a full pool they are done page by page, and a sequence that
    still cannot get one is preempted (recomputed later), never an engine error."""
    import random

    from replicas.config import EngineConfig
    from replicas.engine import LLMEngine
    eng = LLMEngine(EngineConfig(kv_policy="pask", kv_cache_bytes=2 << 20, max_num_seqs=32))
    rng, n, finished = random.Random(0), 0, 0
    for step in range(200):
        while len(eng._seqs) < 12:
            ids = eng.tokenizer.apply_chat_template([{"role": "user", "content": f"Weather in city {n}?"}],
                                                    tools=TOOLS, add_generation_prompt=True,
                                                    return_dict=True)["input_ids"]
            eng.add_request(f"r{n}", ids, SamplingParams(max_tokens=64),
                            GrammarSpec("tools", {"tools": TOOLS, "tool_choice": "auto"}))
            n += 1
        if step % 3 == 0:
            eng.set_replica_budget(rng.choice([1.0, 0.5, 0.25, 0.15]))
        finished += sum(o.finished for o in eng.step())
        assert eng.kv.bytes_used <= eng.kv.cfg.max_bytes
    assert finished > 5


def test_replica_budget_is_never_applied_below_a_prompts_floors(chat_prompts):
    from replicas.config import EngineConfig
    from replicas.engine import LLMEngine
    eng = LLMEngine(EngineConfig(kv_policy="pask", kv_cache_bytes=64 << 20))
    eng.add_request("a", chat_prompts[0], SamplingParams(max_tokens=4), kv_budget=0.9)
    seq = eng._seqs["a"]
    assert 0 < seq.floor_budget < 0.9
    eng.set_replica_budget(0.05)                 # below the floors: the sequence stops at them
    assert seq.kv_budget == pytest.approx(seq.floor_budget)
    eng.set_replica_budget(0.5)
    assert seq.kv_budget == 0.5
    eng.set_replica_budget(1.0)                  # never above what the request asked
    assert seq.kv_budget == 0.9
    with pytest.raises(ValueError, match="replica budget"):
        eng.set_replica_budget(0.0)


@pytest.mark.parametrize("name", ["pask", "compilerkv+pask"])
def test_decode_side_is_not_drained_when_the_prompt_fills_the_budget(chat_prompts, name):
    """At budget 0.5 the prompt side is sized to the whole budget at prefill; the budget state must
    then demote both sides together, not send every generated token to its floor (decode state 0),
    which is what draining the decode side first did (shipped table: state [56, 92] -> [53, 0])."""
    from replicas.config import EngineConfig
    from replicas.engine import LLMEngine
    eng = LLMEngine(EngineConfig(kv_policy=name, kv_budget=0.5, kv_cache_bytes=64 << 20))
    spec = GrammarSpec("tools", {"tools": TOOLS, "tool_choice": "required"})
    for i, prompt in enumerate(chat_prompts[:2]):
        eng.add_request(f"drain-{i}", prompt, SamplingParams(max_tokens=24), spec)
        seq = eng._seqs[f"drain-{i}"]
        start = None
        while not seq.is_finished:
            eng.step()
            start = start or list(seq.policy_state["pask_k"])
        assert start[1] > 0 and seq.policy_state["pask_k"][1] > 0, (start, seq.policy_state["pask_k"])
        assert seq.metrics.kv_ratio_max <= 0.5 + 1e-6


def test_a_default_budget_below_the_floors_says_it_is_the_servers(chat_prompts, caplog):
    """A server default below PASK's floors is warned about at start; a request that sends no
    kv_budget and is refused for it is told so (and the budget a short prompt was raised to is
    named)."""
    from replicas.config import EngineConfig
    from replicas.engine import LLMEngine
    with caplog.at_level("WARNING", logger="replicas.engine"):
        eng = LLMEngine(EngineConfig(kv_policy="pask", kv_budget=0.02, kv_cache_bytes=64 << 20))
    assert "kv_budget 0.02 is below kv_policy 'pask''s floors" in caplog.text
    with pytest.raises(InvalidRequestError, match=r"floors keep .* budget of 0\.02;.*sent no kv_budget, so the "
                                                  r"server's default kv_budget 0\.02 applies"):
        eng.add_request("a", chat_prompts[1] * 3)
    with pytest.raises(InvalidRequestError, match=r"budget 0\.02 was raised to 0\.0625: one 16-token page per "
                                                  r"layer for this 250-token prompt"):
        eng.add_request("b", (chat_prompts[1] * 3)[:250], kv_budget=0.02)
