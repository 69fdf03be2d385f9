"""Baseline policies on a hand-built attention pattern: each keeps what its paper says, budgets hold
at every step, released tokens never return, positions stay true."""


import pytest
import torch

from replicas.errors import InvalidRequestError
from replicas.kv_cache import KVCache, KVCacheConfig, Precision
from replicas.policies import (BASELINES, H2OPolicy, PyramidKVPolicy, RandomPolicy, RecencyPolicy,
                               SnapKVPolicy, StreamingLLMPolicy, make_policy)
from replicas.policy import DecodeView, PrefillView
from replicas.sampling_params import SamplingParams
from replicas.sequence import Sequence

N, HEAVY, D = 32, (5, 17), 8


def build(budget=0.5, layers=2):
    """A cache with N prompt tokens whose keys make tokens HEAVY draw almost all attention."""
    torch.manual_seed(0)
    kv = KVCache(KVCacheConfig(num_layers=layers, num_kv_heads=1, head_dim=D, block_size=4, max_bytes=1 << 22))
    seq = Sequence("s", list(range(N)), SamplingParams())
    seq.kv_budget = budget
    kv.add_sequence("s")
    direction = torch.zeros(D)
    direction[0] = 1.0
    keys = torch.randn(N, 1, D) * 0.1
    for h in HEAVY:
        keys[h, 0] = direction * 8
    for layer in range(layers):
        kv.append("s", layer, range(N), keys, torch.randn(N, 1, D))
    queries = {layer: direction.expand(N, 2, D).clone() for layer in range(layers)}
    return kv, seq, queries


def run_prefill(policy, budget=0.5, layers=2):
    kv, seq, queries = build(budget, layers)
    window = policy.observation_window
    view = PrefillView(seq, kv, N, {l: q[-window:] for l, q in queries.items()} if window else {}, budget)
    for a in policy.on_prefill(view):
        kv.set_precision("s", a.layer, a.positions, a.precision)
    return kv, seq, queries


def kept(kv, layer=0):
    return sorted(kv.kept("s", layer))


def ratio(kv, n):
    return kv.sequence_bytes("s") / kv.full_kv_bytes(n)


def test_streaming_llm_keeps_sinks_and_recent():
    kv, _, _ = run_prefill(StreamingLLMPolicy())
    # budget 0.5: floor(0.5 * 2 layers * 8 pages) = 8 pages, 4 per layer = 16 tokens
    assert kept(kv) == [0, 1, 2, 3] + list(range(20, 32))


def test_recency_keeps_last_tokens():
    kv, _, _ = run_prefill(RecencyPolicy())
    assert kept(kv) == list(range(16, 32))


def test_h2o_keeps_heavy_hitters_and_recent_window():
    kv, _, _ = run_prefill(H2OPolicy())
    k = kept(kv)
    assert len(k) == 16 and set(HEAVY) <= set(k) and set(range(24, 32)) <= set(k)


def test_snapkv_keeps_window_and_voted_tokens():
    kv, _, _ = run_prefill(SnapKVPolicy(window_size=4, kernel_size=1))
    k = kept(kv)
    assert len(k) == 16 and set(HEAVY) <= set(k) and set(range(28, 32)) <= set(k)


def test_snapkv_pooling_keeps_neighbours():
    kv, _, _ = run_prefill(SnapKVPolicy(window_size=4, kernel_size=5))
    # 16 tokens: the 4-token window, then the heavy hitters with the 2 neighbours on each side
    # that average pooling lifts to the same score
    k = kept(kv)
    assert set(range(28, 32)) | set(range(3, 8)) | set(range(15, 20)) <= set(k)


def test_pyramidkv_budgets_decrease_with_depth_same_total():
    p = PyramidKVPolicy(window_size=4)
    pages = p.layer_split(6, 60, 4)
    assert sum(pages) == 60 and pages == sorted(pages, reverse=True) and pages[0] > pages[-1]
    kv, _, _ = run_prefill(PyramidKVPolicy(window_size=4, kernel_size=1))
    # 8 pages over 2 layers: window 4 + a pyramid over the remaining 12 tokens per layer (beta 20)
    assert [len(kept(kv, 0)), len(kept(kv, 1))] == [28, 4]
    assert set(HEAVY) <= set(kept(kv, 0)) and kept(kv, 1) == [28, 29, 30, 31]


def test_pyramidkv_total_budget_keeps_generated_tokens_in_every_layer():
    """Issue 19 item 9: under a total budget the pyramid was drawn over the whole quota, so the
    last layers' share (window + extra / beta) filled with generated tokens and the deep layers lost
    the prompt. As in the paper, every layer keeps the window and the generated tokens, and only
    the rest of the budget forms the pyramid (6 layers, pages of 16, budget 0.33)."""
    p = PyramidKVPolicy()
    p.block_size = 16
    for prompt, generated in ((1000, 50), (1000, 0), (2000, 120), (300, 80)):
        seq = Sequence("s", list(range(prompt)), SamplingParams())
        seq.output_token_ids = [0] * generated
        n = prompt + generated
        quotas = p.layer_quotas(seq, 6, 0.33, n)
        pages = int(0.33 * 6 * -(-n // 16))
        assert sum(quotas) == pages * 16 and quotas == sorted(quotas, reverse=True)
        if pages * 16 >= 6 * (p.window_size + generated + 16):   # room for a pyramid above them
            assert min(quotas) >= p.window_size + generated - 16 and quotas[0] > quotas[-1] + 16
        elif pages * 16 <= 6 * (p.window_size + generated):      # none: uniform, as SnapKV
            assert max(quotas) - min(quotas) <= 16


def test_random_is_reproducible_per_request():
    a, _, _ = run_prefill(RandomPolicy(seed=3))
    b, _, _ = run_prefill(RandomPolicy(seed=3))
    c, _, _ = run_prefill(RandomPolicy(seed=4))
    assert kept(a) == kept(b) and len(kept(a)) == 16 and kept(a) != kept(c)


@pytest.mark.parametrize("name", list(BASELINES))  # PASK: tests/replicas/test_pask_policy.py
@pytest.mark.parametrize("budget", [0.5, 0.25])
def test_decode_budget_never_exceeded_released_never_return(name, budget):
    policy = make_policy(name, **({"window_size": 4} if name in ("snapkv", "pyramidkv") else {}))
    kv, seq, _ = run_prefill(policy, budget)
    assert ratio(kv, N) <= budget
    ever_released = {l: set(range(N)) - set(kept(kv, l)) for l in range(2)}
    direction = torch.zeros(D)
    direction[0] = 1.0
    for step in range(20):
        pos = N + step
        for layer in range(2):
            kv.append("s", layer, [pos], torch.randn(1, 1, D) * 0.1, torch.randn(1, 1, D))
        seq.output_token_ids.append(0)
        view = DecodeView(seq, kv, pos, budget, {l: direction.expand(2, D).clone() for l in range(2)})
        for a in policy.on_decode(view):
            kv.set_precision("s", a.layer, a.positions, a.precision)
        assert ratio(kv, pos + 1) <= budget + 1e-12
        for layer in range(2):
            now = set(kept(kv, layer))
            assert not now & ever_released[layer]  # released tokens never come back
            ever_released[layer] |= set(range(pos + 1)) - now
            positions, _, _ = kv.gather("s", layer)
            assert set(positions.tolist()) == now  # entries carry their true positions


def test_policies_hold_budget_in_the_engine(engine, chat_prompts):
    from replicas.config import EngineConfig
    from replicas.engine import LLMEngine
    for name in ("h2o", "snapkv"):
        eng = LLMEngine(EngineConfig(kv_policy=name, kv_budget=0.33, kv_cache_bytes=64 << 20))
        outs = eng.generate(chat_prompts[:3], SamplingParams(max_tokens=20, ignore_eos=True))
        for o in outs:
            assert o.metrics.kv_ratio_max <= 0.33 and o.metrics.budget_fallbacks == 0
        assert eng.kv.bytes_used == 0


def test_bad_settings_refused_before_work(engine, chat_prompts):
    with pytest.raises(ValueError, match="unknown KV policy 'snap'"):
        make_policy("snap")
    with pytest.raises(ValueError, match="bad settings"):
        make_policy("h2o", window=3)
    with pytest.raises(ValueError, match="recent_ratio"):
        H2OPolicy(recent_ratio=2.0)
    with pytest.raises(InvalidRequestError, match="kv_budget must be in"):
        engine.add_request("b", chat_prompts[0], SamplingParams(max_tokens=2), kv_budget=1.5)
    with pytest.raises(InvalidRequestError, match="policy 'full' keeps all KV"):
        engine.add_request("b", chat_prompts[0], SamplingParams(max_tokens=2), kv_budget=0.5)
    kv, _, _ = build()
    with pytest.raises(ValueError, match="needs 40 tokens per layer"):
        StreamingLLMPolicy(num_sinks=40).check(N, 0.5, kv)


# ------------------------------------------------------------------ prefill budget (token count)
def decode_steps(policy, kv, seq, steps, budget=1.0, layers=2):
    """Append ``steps`` decode tokens, letting the policy act after each; yields the position."""
    direction = torch.zeros(D)
    direction[0] = 1.0
    for step in range(steps):
        pos = N + step
        for layer in range(layers):
            kv.append("s", layer, [pos], torch.randn(1, 1, D) * 0.1, torch.randn(1, 1, D))
        seq.output_token_ids.append(0)
        view = DecodeView(seq, kv, pos, budget, {l: direction.expand(2, D).clone() for l in range(layers)})
        for a in policy.on_decode(view):
            kv.set_precision("s", a.layer, a.positions, a.precision)
        yield pos


def test_streaming_llm_prefill_tokens_keeps_sinks_and_last():
    kv, seq, _ = run_prefill(StreamingLLMPolicy(prefill_tokens=10), budget=1.0)
    assert kept(kv, 0) == kept(kv, 1) == [0, 1, 2, 3] + list(range(26, 32))


def test_snapkv_prefill_tokens_keeps_heavy_window_and_every_generated_token():
    policy = SnapKVPolicy(window_size=4, kernel_size=1, prefill_tokens=6)
    kv, seq, _ = run_prefill(policy, budget=1.0)
    prompt_kept = kept(kv, 0)
    assert prompt_kept == sorted([*HEAVY, 28, 29, 30, 31])
    for pos in decode_steps(policy, kv, seq, 12):
        for layer in range(2):
            assert kept(kv, layer) == prompt_kept + list(range(N, pos + 1))


@pytest.mark.parametrize("name", list(BASELINES))
def test_prefill_tokens_quota_is_b_plus_generated(name):
    B = 8
    policy = make_policy(name, prefill_tokens=B, **({"window_size": 4} if name in ("snapkv", "pyramidkv") else {}))
    kv, seq, _ = run_prefill(policy, budget=1.0)
    assert sum(len(kept(kv, l)) for l in range(2)) == 2 * B
    for pos in decode_steps(policy, kv, seq, 10):
        generated = pos + 1 - N
        assert sum(len(kept(kv, l)) for l in range(2)) == 2 * (B + generated)
        if name not in ("h2o", "random"):   # the others rank generated tokens first
            for layer in range(2):
                assert set(range(N, pos + 1)) <= set(kept(kv, layer))


def test_cap_and_refill_moves_what_a_layer_cannot_hold():
    from replicas.policies.base import cap_and_refill
    assert cap_and_refill([10, 6, 2], 7) == [7, 7, 4]
    assert cap_and_refill([5, 5], 7) == [5, 5]
    assert cap_and_refill([20, 20], 7) == [7, 7]          # more than all layers hold: capped


def test_pyramidkv_never_gives_a_layer_more_than_the_prompt():
    """Found in review: a prompt a little longer than B lost the first layers' surplus (the reference
    code clamps them and lifts the others)."""
    p = PyramidKVPolicy(window_size=4, kernel_size=1, prefill_tokens=20)
    split = p.layer_split(2, 40, 1)
    assert split[0] > N        # the pyramid alone would give layer 0 more than the 32-token prompt
    kv, _, _ = run_prefill(p, budget=1.0)
    assert [len(kept(kv, l)) for l in range(2)] == [N, 40 - N]


def test_recomputed_sequence_keeps_its_generated_tokens():
    """After a preemption the engine prefills prompt + outputs again: B still applies to the prompt,
    and SnapKV keeps the outputs as its decode steps did."""
    kv, seq, queries = build(1.0)
    seq.prompt_token_ids, seq.output_token_ids = list(range(N - 8)), [0] * 8
    policy = SnapKVPolicy(window_size=4, kernel_size=1, prefill_tokens=6)
    view = PrefillView(seq, kv, N, {l: q[-4:] for l, q in queries.items()}, 1.0)
    for a in policy.on_prefill(view):
        kv.set_precision("s", a.layer, a.positions, a.precision)
    for layer in range(2):
        assert set(range(N - 8, N)) <= set(kept(kv, layer)) and len(kept(kv, layer)) == 6 + 8


def test_pyramidkv_prefill_tokens_split_decreases_with_depth():
    p = PyramidKVPolicy(window_size=4, kernel_size=1, prefill_tokens=12)
    kv, _, _ = run_prefill(p, budget=1.0)
    counts = [len(kept(kv, l)) for l in range(2)]
    assert sum(counts) == 24 and counts[0] > counts[1] >= 4


def test_prefill_tokens_bad_settings_refused():
    kv, _, _ = build()
    for bad in (0, -3, 1.5, True):
        with pytest.raises(ValueError, match="prefill_tokens must be a positive int"):
            SnapKVPolicy(prefill_tokens=bad)
    with pytest.raises(ValueError, match="use kv_budget 1.0"):
        H2OPolicy(prefill_tokens=16).check(N, 0.5, kv)
    with pytest.raises(ValueError, match="needs 4 tokens per layer"):
        StreamingLLMPolicy(prefill_tokens=2).check(N, 1.0, kv)
    StreamingLLMPolicy(prefill_tokens=2).check(2, 1.0, kv)  # a prompt within B is never compressed


@pytest.mark.parametrize("observe_bytes", [256 << 20, 1])   # all layers in one group; a layer per group
def test_h2o_batched_observation_equals_per_sequence_attention(monkeypatch, observe_bytes):
    """H2O's decode step adds, for the whole batch at once, what ``attention_probs`` gives one
    sequence at a time over its kept keys (holes from releases included), whatever the layer
    groups its memory bound makes."""
    from replicas.policies import h2o
    from replicas.policies.base import attention_probs
    monkeypatch.setattr(h2o, "OBSERVE_BYTES", observe_bytes)
    torch.manual_seed(2)
    kv = KVCache(KVCacheConfig(num_layers=2, num_kv_heads=1, head_dim=D, block_size=4, max_bytes=1 << 22))
    policy, seqs = H2OPolicy(), []
    for i, n in enumerate((9, 14, 5)):
        seq = Sequence(f"s{i}", list(range(n)), SamplingParams())
        kv.add_sequence(seq.request_id)
        for layer in range(2):
            kv.append(seq.request_id, layer, range(n), torch.randn(n, 1, D), torch.randn(n, 1, D))
        kv.set_precision(seq.request_id, 1, [0, 3], Precision.RELEASED)
        seqs.append(seq)
    rows = torch.tensor([kv.row(s.request_id) for s in seqs])
    positions = torch.tensor([s.num_tokens - 1 for s in seqs])
    queries = {layer: torch.randn(3, 2, D) for layer in range(2)}
    table = policy.scores(kv)
    table[rows] = 0.0
    policy.observe_decode_batch(seqs, kv, rows, positions, queries)
    for i, seq in enumerate(seqs):
        for layer in range(2):
            pos, k, _ = kv.gather(seq.request_id, layer)
            want = attention_probs(queries[layer][i][None], positions[i:i + 1], k, pos)
            torch.testing.assert_close(table[rows[i], layer, pos], want)


def test_eviction_ranks_kept_slots_and_breaks_ties_by_position():
    """Decode eviction ranks each pair's kept entries in slot order (swap-removes leave slots out
    of position order); among equal scores it must still release the lowest position, as an
    argmin over positions does."""
    from replicas.policies.base import _lowest
    scores = torch.tensor([[3.0, 1.0, 1.0, 2.0], [5.0, 5.0, 5.0, float("inf")]])
    positions = torch.tensor([[7, 9, 4, 1], [8, 2, 6, 0]])   # slot order, not position order
    assert _lowest(scores, positions).tolist() == [4, 2]     # the +inf slot (past the entries) never wins


@pytest.mark.parametrize("name", ["snapkv", "streaming_llm", "pyramidkv", "recency"])
def test_static_victims_equal_a_full_ranking_every_step(monkeypatch, engine, chat_prompts, name):
    """Policies with ``static_scores`` take each decode eviction from a ranking made once per row;
    every victim must be the one ranking all kept entries picks (lowest score, then position),
    through generated tokens evicted (budget 0.15), entries released by another path, a replica
    budget that falls mid-run (several releases at once, then a new ranking) and a preemption (the
    row recomputed)."""
    from replicas.config import EngineConfig
    from replicas.engine import LLMEngine
    from replicas.policies.base import ScoredPolicy, _lowest
    fast = ScoredPolicy._static_victims
    seen = {"steps": 0, "ranked": 0}
    rank = ScoredPolicy._rank

    def checked(self, kv, table, r, li, next_pos, ids):
        s, pos = self._kept_scores(kv, table, r, li, None, None)
        want = _lowest(s, pos)
        got = fast(self, kv, table, r, li, next_pos, ids)
        assert torch.equal(got, want)
        seen["steps"] += 1
        return got

    def counted(self, *a):
        seen["ranked"] += 1
        return rank(self, *a)

    monkeypatch.setattr(ScoredPolicy, "_static_victims", checked)
    monkeypatch.setattr(ScoredPolicy, "_rank", counted)
    eng = LLMEngine(EngineConfig(kv_policy=name, kv_budget=0.3, kv_cache_bytes=8 << 20, max_num_seqs=6,
                                 enforce_eager=True))
    for i, p in enumerate([p for p in chat_prompts if len(p) < 400] * 2):   # 229-383 tokens
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=60, ignore_eos=True, temperature=0.8, seed=i))
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        if steps == 15:   # a running sequence recomputes later: its row is ranked anew
            victim = next(q for q in eng.scheduler.running if len(q.output_token_ids) > 5)
            eng.scheduler.preempt(victim)
            ranked_before = seen["ranked"]
        if steps == 20:   # another path releases the entry each layer of a row would release next
            seq = eng.scheduler.running[0]
            rid, row = seq.request_id, eng.kv.row(seq.request_id)
            policy = eng.policy
            for layer in range(eng.kv.cfg.num_layers):
                s, pos = policy._kept_scores(eng.kv, policy.scores(eng.kv), torch.tensor([row]),
                                             torch.tensor([layer]), None, None)
                eng.kv.set_precision(rid, layer, _lowest(s, pos).tolist(), Precision.RELEASED)
        if steps == 25:
            eng.set_replica_budget(0.15)
    assert victim.metrics.num_preemptions == 1 and len(victim.output_token_ids) == 60
    assert seen["ranked"] > ranked_before
    assert seen["steps"] > 3 * seen["ranked"] > 0
