"""CompilerKV online pieces: utility, gate, table lookups, top-B clamp, and the engine path."""


import pytest
import torch

from replicas.kv_cache import Precision
from replicas.policies import CompilerKVPolicy, CompilerKVTables
from replicas.policies.compilerkv import gate_record, gated_keep_count, token_utility
from replicas.sampling_params import SamplingParams


def test_utility_follows_attention_and_value_norm():
    d = 4
    k = torch.zeros(6, 1, d)
    k[2, 0, 0] = 20.0                        # every query looks at token 2
    v = torch.ones(6, 1, d)
    q = torch.zeros(2, 2, d)
    q[:, :, 0] = 1.0
    util, ent = token_utility(q, torch.tensor([4, 5]), k, v, torch.arange(6), kernel=1)
    assert util.shape == (2, 6) and torch.allclose(util.sum(-1), torch.ones(2))
    assert util[:, 2].min() > 0.99 and 0.0 <= ent < 0.05
    v[2] = 0.0                                # a zero value vector carries nothing
    util, _ = token_utility(q, torch.tensor([4, 5]), k, v, torch.arange(6), kernel=1)
    assert util[:, 2].max() < 1e-6
    flat, ent = token_utility(torch.zeros(2, 2, d), torch.tensor([4, 5]), torch.zeros(6, 1, d),
                              torch.ones(6, 1, d), torch.arange(6), kernel=1)
    assert ent == pytest.approx(1.0, abs=1e-5)           # uniform attention: maximal entropy
    assert flat[:, 5].min() < flat[:, 0].min()           # causal: token 5 seen by one query only


def test_pooling_spreads_utility_to_neighbours():
    k = torch.zeros(9, 1, 2)
    k[4, 0, 0] = 20.0
    q = torch.zeros(1, 1, 2)
    q[0, 0, 0] = 1.0
    util, _ = token_utility(q, torch.tensor([8]), k, torch.ones(9, 1, 2), torch.arange(9), kernel=3)
    assert util[0, 3] > 0.2 and util[0, 5] > 0.2 and util[0, 0] < 0.01
    with pytest.raises(ValueError, match="odd"):
        token_utility(q, torch.tensor([8]), k, torch.ones(9, 1, 2), torch.arange(9), kernel=2)


def test_gate_keeps_fewest_tokens_reaching_the_threshold_clamped_to_b():
    s = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05])
    assert gated_keep_count(s, 0.8, 5) == 2
    assert gated_keep_count(s, 0.81, 5) == 3
    assert gated_keep_count(s, 1.0, 3) == 3          # clamp to top-B
    assert gated_keep_count(torch.zeros(4), 0.9, 2) == 2


def tables(layers=6, heads=8):
    return CompilerKVTables(torch.tensor([256, 512, 1024]), torch.ones(3, layers, heads),
                            torch.full((3, layers, 4, 2), 1.0), torch.tensor([0.25, 0.5, 0.75]), torch.tensor([10.0]))


def test_table_lookup_bins_and_shape_checks():
    t = tables()
    t.gate[1, 2, 3, 1] = 0.85
    t.head_weights[1, 2, 5] = 1.4
    w, thr = t.lookup(500, 2, 0.9, 30.0)
    assert thr == pytest.approx(0.85) and w[5] == pytest.approx(1.4)
    assert t.lookup(500, 2, 0.1, 3.0)[1] == 1.0
    with pytest.raises(ValueError, match="gate must be"):
        CompilerKVTables(t.budgets, t.head_weights, t.gate[:, :, :2], t.entropy_edges, t.ppl_edges)


def test_engine_keeps_window_plus_top_b_per_layer(engine, chat_prompts):
    prompt = chat_prompts[2]
    n = len(prompt)
    saved, engine.policy = engine.policy, CompilerKVPolicy(prefill_tokens=64, window=16, tables=tables())
    try:
        engine.add_request("ckv", prompt, SamplingParams(max_tokens=2), kv_budget=1.0)
        seq = engine._seqs["ckv"]
        engine.step()                     # prefill (+ first token)
        for layer in range(6):
            kept = engine.kv.kept("ckv", layer)
            prompt_kept = [p for p in kept if p < n]
            assert len(prompt_kept) <= 64 and set(range(n - 16, n)) <= set(prompt_kept)
            assert all(kept[p] == Precision.HIGH for p in prompt_kept)
        assert seq.metrics.budget_fallbacks == 0
        # T = 1 asks for every token: the top-B clamp (64 - 16 window) sets each layer's count
        assert all(g["gated"] > g["clamp"] == 48 for g in gate_record(seq.policy_state, 64).values())
    finally:
        engine.abort("ckv")
        engine.policy = saved
    t = tables()
    t.gate[:] = 0.05                      # a gate that asks for very few tokens decides the count
    engine.policy = CompilerKVPolicy(prefill_tokens=64, window=16, tables=t)
    try:
        engine.add_request("ckv2", prompt, SamplingParams(max_tokens=2), kv_budget=1.0)
        seq = engine._seqs["ckv2"]
        engine.step()
        for layer, g in gate_record(seq.policy_state, 64).items():
            assert g["threshold"] == pytest.approx(0.05) and g["gated"] < g["clamp"]
            assert len([p for p in engine.kv.kept("ckv2", layer) if p < n]) == 16 + g["gated"]
    finally:
        engine.abort("ckv2")
        engine.policy = saved


def test_combined_policy_holds_a_total_budget(engine, chat_prompts, tmp_path):
    import sys
    sys.path.insert(0, "tests/replicas")
    from test_pask_policy import graded_table

    from calibration.artifacts import TableArtifact, model_fingerprint
    from models import EMBEDDED_MODEL_DIR
    from replicas.grammar import GrammarSpec
    from replicas.policies import CompilerKVPASKPolicy
    TableArtifact("pask", graded_table().to_tables(), model_fingerprint(EMBEDDED_MODEL_DIR)).save(tmp_path / "p")
    policy = CompilerKVPASKPolicy(pask_table=str(tmp_path / "p"), window=16)
    policy.bind_model(EMBEDDED_MODEL_DIR)
    saved, engine.policy = engine.policy, policy
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}]
    try:
        engine.add_request("comb", chat_prompts[2], SamplingParams(max_tokens=24),
                           GrammarSpec("tools", {"tools": tools, "tool_choice": "required"}), kv_budget=0.33)
        seq = engine._seqs["comb"]
        while not seq.is_finished:
            engine.step()
            if not seq.is_finished:
                assert engine.kv.sequence_bytes("comb") <= 0.33 * engine.kv.full_kv_bytes(seq.num_tokens) + 1e-6
        assert seq.metrics.budget_fallbacks == 0 and seq.metrics.kv_ratio_max <= 0.33
    finally:
        engine.abort("comb")
        engine.policy = saved
    with pytest.raises(ValueError, match="compilerkv\\+pask"):
        CompilerKVPolicy(prefill_tokens=64).check(100, 0.5, engine.kv)


def test_prefill_decode_composition(engine, chat_prompts, tmp_path):
    """compilerkv+pask is PrefillDecodePolicy(CompilerKV, PASK decode side): composing the two by
    hand gives the same spec and the same greedy tokens; a policy without the hooks is refused."""
    import sys
    sys.path.insert(0, "tests/replicas")
    from test_pask_policy import graded_table

    from calibration.artifacts import TableArtifact, model_fingerprint
    from models import EMBEDDED_MODEL_DIR
    from replicas.policies import CompilerKVPASKPolicy, PASKPolicy, PrefillDecodePolicy, SnapKVPolicy
    TableArtifact("pask", graded_table().to_tables(), model_fingerprint(EMBEDDED_MODEL_DIR)).save(tmp_path / "p")
    named = CompilerKVPASKPolicy(pask_table=str(tmp_path / "p"), window=16)
    by_hand = PrefillDecodePolicy(CompilerKVPolicy(window=16), PASKPolicy(str(tmp_path / "p"), prompt_side=False))
    assert named.name == "compilerkv+pask" and by_hand.name == "compilerkv+pask"
    assert named.spec == by_hand.spec
    assert named.spec.needs_tags and named.spec.wants_window_ppl and named.spec.observation_window == 16
    assert named.spec.table_kinds == ("pask",) and not named.spec.prompt_only
    assert named.spec.precisions == (Precision.HIGH, Precision.INT8, Precision.INT4)
    tokens = []
    saved = engine.policy
    try:
        for i, policy in enumerate((named, by_hand)):
            policy.bind_model(EMBEDDED_MODEL_DIR)
            engine.policy = policy
            engine.add_request(f"comp{i}", chat_prompts[2], SamplingParams(max_tokens=24), kv_budget=0.33)
            seq = engine._seqs[f"comp{i}"]
            while not seq.is_finished:
                engine.step()
            tokens.append(list(seq.output_token_ids))
            assert seq.metrics.kv_ratio_max <= 0.33
    finally:
        engine.policy = saved
    assert tokens[0] == tokens[1] and len(tokens[0]) > 0
    with pytest.raises(TypeError, match="not a prompt compressor"):
        PrefillDecodePolicy(PASKPolicy(prompt_side=False), PASKPolicy(prompt_side=False))
    with pytest.raises(TypeError, match="not a decode compressor"):
        PrefillDecodePolicy(CompilerKVPolicy(), SnapKVPolicy())


def test_budget_as_a_fraction_of_the_prompt():
    p = CompilerKVPolicy(prefill_fraction=0.25)
    assert p.keep_tokens(400) == 100 and p.keep_tokens(3) == 1
    with pytest.raises(ValueError, match="not both"):
        CompilerKVPolicy(prefill_tokens=64, prefill_fraction=0.5)
    with pytest.raises(ValueError, match="prefill_fraction"):
        CompilerKVPolicy(prefill_fraction=1.5)


def two_head_view(n=24, d=8):
    """A prompt whose head 0 looks at token 5 and head 1 (a little more sharply) at token 17."""
    from replicas.kv_cache import KVCache, KVCacheConfig
    from replicas.policy import PrefillView
    from replicas.sequence import Sequence
    torch.manual_seed(0)
    kv = KVCache(KVCacheConfig(num_layers=1, num_kv_heads=2, head_dim=d, block_size=4, max_bytes=1 << 22))
    kv.add_sequence("s")
    keys = torch.randn(n, 2, d) * 0.05
    keys[5, 0, 0], keys[17, 1, 0] = 6.0, 7.0
    kv.append("s", 0, range(n), keys, torch.ones(n, 2, d))
    q = torch.zeros(4, 2, d)
    q[:, :, 0] = 1.0
    return PrefillView(Sequence("s", list(range(n)), SamplingParams()), kv, n, {0: q}, 1.0, window_ppl=3.0)


def test_ablation_switches_drop_the_head_table_and_the_gate():
    t = CompilerKVTables(torch.tensor([8]), torch.tensor([[[1.5, 0.5]]]), torch.tensor([[[[0.6], [0.9]]]]),
                         torch.tensor([0.5]), torch.empty(0))
    view = two_head_view()
    full = CompilerKVPolicy(prefill_tokens=8, window=4, kernel=1, tables=t)
    _, score, thr = full.layer_scores(view, 0, 5)
    assert int(score.argmax()) == 5                   # head 0 weighted up: its token wins
    assert thr in (pytest.approx(0.6), pytest.approx(0.9))   # the gate cell of this prompt's bins
    _, score, thr_nh = CompilerKVPolicy(prefill_tokens=8, window=4, kernel=1, tables=t,
                                        use_head_weights=False).layer_scores(view, 0, 5)
    assert int(score.argmax()) == 17 and thr_nh == thr   # equal weights: the sharper head wins
    _, _, thr = CompilerKVPolicy(prefill_tokens=8, window=4, kernel=1, tables=t, use_gate=False).layer_scores(view, 0, 5)
    assert thr == pytest.approx(0.75) == t.mean_threshold(5)   # mean of the compiled gate
    _, _, thr = CompilerKVPolicy(prefill_tokens=8, window=4, kernel=1, tables=t, use_gate=False,
                                 fixed_threshold=0.95).layer_scores(view, 0, 5)
    assert thr == pytest.approx(0.95)
    with pytest.raises(ValueError, match="fixed_threshold"):
        CompilerKVPolicy(fixed_threshold=0.0)


def test_shipped_tables_are_the_default(engine):
    from calibration import shipped_table
    from models import EMBEDDED_MODEL_DIR
    p = CompilerKVPolicy(prefill_tokens=64)
    p.bind_model(EMBEDDED_MODEL_DIR)
    assert (shipped_table("compilerkv", EMBEDDED_MODEL_DIR) / "manifest.json").is_file()
    assert isinstance(p.tables, CompilerKVTables)


def test_pooling_width_follows_the_tables():
    """The utility's pooling width is the one the tables were compiled with (their manifest),
    unless given; tables without a recorded width were built with 5."""
    import json
    from calibration import shipped_table
    from models import EMBEDDED_MODEL_DIR
    shipped = shipped_table("compilerkv", EMBEDDED_MODEL_DIR)
    width = json.loads((shipped / "manifest.json").read_text())["meta"]["settings"]["kernel"]
    p = CompilerKVPolicy(prefill_tokens=64)
    p.bind_model(EMBEDDED_MODEL_DIR)
    assert p.kernel == width
    p = CompilerKVPolicy(prefill_tokens=64, kernel=3)
    p.bind_model(EMBEDDED_MODEL_DIR)
    assert p.kernel == 3
    assert CompilerKVPolicy(prefill_tokens=64).kernel is None    # no tables yet: DEFAULT_KERNEL at use
    for bad in (0, 4, -1, 9.5, True):
        with pytest.raises(ValueError, match="kernel must be a positive odd int width"):
            CompilerKVPolicy(prefill_tokens=64, kernel=bad)


def test_gate_mean_weighted_by_calibration_visits():
    """Found in review: unvisited gate cells hold the default 1.0, so a plain mean over cells made
    the no-gate ablation all but T = 1; the mean is weighted by how often prompts used each cell."""
    gate = torch.tensor([[[[0.8], [1.0]]]])
    t = CompilerKVTables(torch.tensor([8]), torch.ones(1, 1, 2), gate, torch.tensor([0.5]), torch.empty(0),
                         gate_visits=torch.tensor([[[[9.0], [0.0]]]]))
    assert t.mean_threshold(8) == pytest.approx(0.8)
    assert CompilerKVTables.from_tables(t.to_tables()).mean_threshold(8) == pytest.approx(0.8)
    t.gate_visits = None
    assert t.mean_threshold(8) == pytest.approx(0.9)   # tables without visits: the plain mean
    with pytest.raises(ValueError, match="gate_visits must have the gate's shape"):
        CompilerKVTables(torch.tensor([8]), torch.ones(1, 1, 2), gate, torch.tensor([0.5]), torch.empty(0),
                         gate_visits=torch.ones(1, 1, 2, 2))
    with pytest.raises(ValueError, match="set use_gate=False"):
        CompilerKVPolicy(fixed_threshold=0.9)
    for bad in (1.5, True, 0):
        with pytest.raises(ValueError, match="prefill_tokens must be a positive int"):
            CompilerKVPolicy(prefill_tokens=bad)


def test_recomputed_sequence_keeps_its_generated_tokens():
    view = two_head_view()
    view.seq.prompt_token_ids, view.seq.output_token_ids = list(range(18)), [0] * 6
    p = CompilerKVPolicy(prefill_tokens=8, window=4, kernel=1)
    for a in p.on_prefill(view):
        view.kv.set_precision("s", a.layer, a.positions, a.precision)
    kept = sorted(view.kv.kept("s", 0))
    assert set(range(18, 24)) <= set(kept) and len([k for k in kept if k < 18]) <= 8


def test_prompt_only_policies_stay_at_budget_one(engine, chat_prompts):
    """A replica budget below 1 has nothing to act on for a policy that compresses the prompt to a
    token count: the request stays at 1.0 instead of losing its oldest pages to the engine's fallback."""
    from replicas.policies import SnapKVPolicy
    saved, engine.policy = engine.policy, SnapKVPolicy(prefill_tokens=32)
    engine.set_replica_budget(0.3)
    try:
        assert engine.floor_budget == 1.0
        engine.add_request("po", chat_prompts[2], SamplingParams(max_tokens=4))
        seq = engine._seqs["po"]
        while not seq.is_finished:
            engine.step()
        assert seq.kv_budget == 1.0 and seq.metrics.budget_fallbacks == 0
    finally:
        engine.set_replica_budget(1.0)
        engine.policy = saved
