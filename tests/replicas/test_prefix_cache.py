"""Prefix cache: a hit gives a miss's greedy tokens, table changes invalidate, preemption and abort
release references, an abort mid-prefill leaves no half-written block, the accounting recounts."""

import random
from types import SimpleNamespace

import pytest
import torch

from replicas.block_manager import BlockManager, KVCacheOutOfMemory
from replicas.config import EngineConfig
from replicas.engine import LLMEngine
from replicas.precision import BITS, Precision
from replicas.prefix_cache import PrefixCache
from replicas.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def _cached(**kw) -> LLMEngine:
    return LLMEngine(EngineConfig(**{"kv_cache_bytes": 64 << 20, "max_num_seqs": 8, "enable_prefix_caching": True,
                                     **kw}))


@pytest.fixture(scope="module")
def shared_prompts(chat_prompts):
    """Four prompts: one long shared prefix (two chat prompts, 16 x k + 5 tokens), different tails."""
    prefix = (chat_prompts[1] + chat_prompts[5])
    prefix = prefix[:len(prefix) // 16 * 16 + 5]      # the prefix ends inside a page
    return [prefix + p[-30 - 7 * i:] for i, p in enumerate(chat_prompts[:4])]


def test_a_hit_gives_the_same_greedy_tokens_as_a_miss(engine, shared_prompts):
    want = [o.token_ids for o in engine.generate(shared_prompts, GREEDY)]
    for chunked in (False, True):
        eng = _cached(enable_chunked_prefill=chunked, max_num_batched_tokens=96 if chunked else 8192)
        first = eng.generate(shared_prompts[:1], GREEDY)           # a miss: fills the cache
        assert eng.stats()["prefix_cache_hits"] == 0
        rest = eng.generate(shared_prompts[1:], GREEDY)            # hits on every page of the prefix
        assert [o.token_ids for o in first + rest] == want
        shared = (len(shared_prompts[0]) - 30) // 16 * 16           # full pages of the common part
        s = eng.stats()
        assert s["prefix_cache_hits"] == 3 * shared
        assert s["prefix_cache_queries"] == sum(map(len, shared_prompts))
        assert s["kv_bytes_used"] == 0 and s["kv_bytes_prefix_cached"] > 0
        eng.kv.prefix.audit()


def test_concurrent_hits_hold_the_prefix_once(shared_prompts):
    eng = _cached()
    eng.generate(shared_prompts[:1], GREEDY)
    for i, p in enumerate(shared_prompts[1:]):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=40, ignore_eos=True))
    eng.step()
    kv, held = eng.kv, 0
    for i in range(3):
        held += kv.sequence_bytes(f"r{i}")
    common = eng.stats()["prefix_cache_hits"] // 3                   # each hit the common prefix
    assert common == (len(shared_prompts[0]) - 30) // 16 * 16
    assert all(kv.shared_tokens(f"r{i}") >= common for i in range(3))
    # Each row reads the common prefix; the pools hold it once (the first request's other pages,
    # cached and unreferenced, are not counted as used).
    assert eng.stats()["kv_bytes_used"] == held - 2 * kv.full_kv_bytes(common)
    kv.prefix.audit()


def test_a_full_prompt_hit_still_computes_its_last_token(engine, shared_prompts):
    prompt = shared_prompts[0][:160]                                   # exactly 10 pages
    eng = _cached()
    a = eng.generate([prompt], GREEDY)[0].token_ids
    b = eng.generate([prompt], GREEDY)[0].token_ids
    assert a == b == engine.generate([prompt], GREEDY)[0].token_ids
    assert eng.stats()["prefix_cache_hits"] == 144                    # 9 pages: the 10th holds the last token


def test_table_publication_invalidates_the_old_versions_entries(shared_prompts, monkeypatch):
    eng = _cached()
    eng.generate(shared_prompts[:1], GREEDY)
    eng.add_request("live", shared_prompts[1], SamplingParams(max_tokens=30, ignore_eos=True))
    eng.step()
    prefix = eng.kv.prefix
    live_blocks = list(prefix.seq_blocks["live"])
    assert live_blocks and prefix.table
    monkeypatch.setattr(eng, "policy", SimpleNamespace(spec=SimpleNamespace(table_kinds=("pask",)),
                                                       swap_table=lambda folder, model: None))
    eng.load_table("pask", "unused", "v2")
    monkeypatch.undo()                                                # the real (full KV) policy again
    assert eng.table_versions == {"pask": "v2"}
    assert not prefix.table and not prefix.idle                       # nothing of the old version is found
    assert all(b.stale for b in live_blocks)                          # still read by "live", freed after it
    prefix.audit()
    eng.add_request("new", shared_prompts[2], GREEDY)
    eng.step()
    assert prefix.seq_blocks["new"] == [] or prefix.seq_blocks["new"][0] not in live_blocks
    while eng.has_unfinished():
        eng.step()
    prefix.audit()
    freed = set(eng.kv.blocks.free_pages[Precision.HIGH])
    assert all(set(b.pages.tolist()) <= freed for b in live_blocks)   # the stale pages went back


def test_preemption_and_abort_release_references(shared_prompts):
    eng = _cached()
    eng.generate(shared_prompts[:1], GREEDY)
    for i, p in enumerate(shared_prompts[1:]):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=30, ignore_eos=True))
    eng.step()
    prefix = eng.kv.prefix
    block = prefix.seq_blocks["r0"][0]
    assert block.refs == 3
    eng.abort("r0")
    assert block.refs == 2
    eng.scheduler.preempt(eng._seqs["r1"])
    assert block.refs == 1
    prefix.audit()
    eng.step()                                                        # r1 comes back: a hit again
    assert block.refs == 2
    while eng.has_unfinished():
        eng.step()
    assert block.refs == 0 and block.hash in prefix.idle
    assert eng.stats()["kv_bytes_used"] == 0
    prefix.audit()


def test_an_abort_mid_prefill_leaves_only_whole_pages_cached(engine, shared_prompts):
    prompt = shared_prompts[0]
    eng = _cached(enable_chunked_prefill=True, max_num_batched_tokens=72)
    eng.add_request("a", prompt, GREEDY)
    eng.step()                                                        # 72 tokens: 4 whole pages and a half
    assert len(eng.kv.prefix.table) == 4
    eng.abort("a")
    eng.kv.prefix.audit()
    # A forward that runs out of pages half-way through its layers caches nothing.
    eng.add_request("b", prompt, GREEDY)
    real_append, calls = eng.kv.append, []

    def failing_append(seq_id, layer, *a, **k):
        calls.append(layer)
        if layer == 3:
            raise KVCacheOutOfMemory("test: the pool ran out at layer 3")
        return real_append(seq_id, layer, *a, **k)
    eng.kv.append = failing_append
    eng.step()
    del eng.kv.append
    assert calls and len(eng.kv.prefix.table) == 4                    # b was preempted, nothing cached
    eng.kv.prefix.audit()
    out = None
    while eng.has_unfinished():
        out = (eng.step() or [out])[-1]
    assert out.token_ids == engine.generate([prompt], GREEDY)[0].token_ids
    eng.kv.prefix.audit()


def test_eviction_makes_room_for_a_miss(engine, shared_prompts, chat_prompts):
    one = engine.kv.full_kv_bytes(len(shared_prompts[0]) + 12)
    eng = _cached(kv_cache_bytes=int(1.6 * one))                      # room for one sequence and a half
    eng.generate(shared_prompts[:1], GREEDY)
    cached = eng.stats()["kv_bytes_prefix_cached"]
    before = eng.kv.prefix.peek(shared_prompts[0])[0]
    assert cached > 0.5 * one and before > 0.9 * len(shared_prompts[0])
    other = (chat_prompts[6] + chat_prompts[7] + chat_prompts[3] * 4)[:len(shared_prompts[0])]   # a miss
    assert eng.kv.full_kv_bytes(len(other) + 12) + cached > int(1.6 * one)
    eng.generate([other], GREEDY)
    after = eng.kv.prefix.peek(shared_prompts[0])[0]
    assert after < before                                             # its last pages went first
    assert eng.kv.prefix.peek(shared_prompts[0][:after + 1])[0] == after   # the rest still hits
    assert eng.kv.bytes_used <= eng.kv.cfg.max_bytes
    eng.kv.prefix.audit()


@pytest.mark.parametrize("policy", ["pask", "snapkv", "compilerkv+pask"])
def test_compressing_policies_hit_and_give_a_miss_tokens(shared_prompts, policy):
    """A compressing policy's prompt attends to a full-precision shadow that shares the cached
    pages, and stores its own copy of the prefix at its targets: the tokens are those of the
    cache off (whole-prompt prefill)."""
    kw = {"kv_policy": policy, "kv_budget": 0.33}
    want = [o.token_ids for o in LLMEngine(EngineConfig(kv_cache_bytes=64 << 20, max_num_seqs=8, **kw))
            .generate(shared_prompts, GREEDY)]
    eng = _cached(**kw)
    got = eng.generate(shared_prompts[:1], GREEDY) + eng.generate(shared_prompts[1:], GREEDY)
    assert [o.token_ids for o in got] == want
    s = eng.stats()
    common = (len(shared_prompts[0]) - 30) // 16 * 16
    window = eng.policy.spec.observation_window                      # computed, never taken from the cache
    assert 3 * (common - window - 16) <= s["prefix_cache_hits"] <= 3 * common
    assert s["kv_bytes_used"] == 0 and not any(isinstance(r, tuple) for r in eng.kv.blocks.rows)   # no shadow left
    eng.kv.prefix.audit()


def test_h2o_never_hits(shared_prompts):
    """H2O scores the prompt with every prompt query: none of it may come from the cache."""
    eng = _cached(kv_policy="h2o", kv_budget=0.33)
    eng.generate(shared_prompts[:1], SamplingParams(max_tokens=1))
    assert eng.kv.prefix.table and eng.kv.prefix_hit(shared_prompts[1]) == (0, 0)


@pytest.fixture(scope="module")
def same_state_prompts(chat_prompts):
    """Five prompts that differ only in their last token: PASK picks the same table state and the
    same targets for their common prefix."""
    base = (chat_prompts[1] + chat_prompts[5])[:400] + chat_prompts[0][-40:]
    return [base[:-1] + [t] for t in (base[-1], 11, 12, 13, 14)]


def test_pask_requests_share_one_compressed_prefix(same_state_prompts):
    kw = {"kv_policy": "pask", "kv_budget": 0.33}
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    want = [o.token_ids for o in LLMEngine(EngineConfig(kv_cache_bytes=64 << 20, max_num_seqs=8, **kw))
            .generate(same_state_prompts, params)]
    eng = _cached(**kw)
    got = [eng.generate(same_state_prompts[:1], params)[0].token_ids]   # a miss: fills the full-KV cache
    for i, p in enumerate(same_state_prompts[1:]):
        eng.add_request(f"r{i}", p, params)
    eng.step()                                                           # r0 compresses the prefix, r1-r3 attach it
    kv, prefix = eng.kv, eng.kv.prefix
    assert len(prefix.snapshots) == 1 and prefix.compressed_hits == 3 * 432
    snap = next(iter(prefix.snapshots.values()))
    assert snap.refs == 4
    held = sum(kv.sequence_bytes(f"r{i}") for i in range(4))
    # Each row reads the compressed prefix; the pools hold its pages once (its full pages, shared
    # in place unless a demotion after prefill copied some of them, and the cache's own tails).
    b = kv.blocks
    shared = [sum(int(b.snap_pages[p][kv.row(f"r{i}")].sum()) * kv.page_cost(p) for p in BITS) for i in range(4)]
    assert min(shared) > 0
    assert eng.stats()["kv_bytes_used"] == held - sum(shared) + snap.nbytes < 0.6 * held
    prefix.audit()
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
        prefix.audit()
        for i in range(4):   # the budget guarantee holds for sharing rows
            if f"r{i}" in kv.seqs:
                seq = eng._seqs[f"r{i}"]
                assert kv.sequence_bytes(f"r{i}") <= 0.33 * kv.full_kv_bytes(seq.num_tokens) + 1e-6
    assert got + [outs[f"r{i}"] for i in range(4)] == want
    assert snap.refs == 0 and snap.key in prefix.idle_snapshots and eng.stats()["kv_bytes_used"] == 0


def test_changing_a_shared_compressed_entry_copies_the_pages_first(same_state_prompts):
    eng = _cached(kv_policy="pask", kv_budget=0.33)
    eng.generate(same_state_prompts[:1], GREEDY)
    for i, p in enumerate(same_state_prompts[1:3]):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=40, ignore_eos=True))
    eng.step()
    kv = eng.kv
    row = kv.row("r1")
    layer, p = 0, next(q for q in BITS if int(kv.blocks.snap_pages[q][row, 0]))
    pos = kv.blocks.slot_position[p][row, layer, :3].long()
    before = [kv.gather("r0", lay) for lay in range(kv.cfg.num_layers)]
    kv.set_precision("r1", layer, pos, Precision.RELEASED)                # r1's own pages now
    assert int(kv.blocks.snap_pages[p][row, layer]) == 0 and kv.blocks.num_unshared_pages > 0
    assert kv.precisions_at("r1", layer, pos).tolist() == [0, 0, 0]
    assert all(int(x) == int(p) for x in kv.precisions_at("r0", layer, pos))
    for lay, (pa, ka, va) in enumerate(before):                           # r0 reads what it read
        pb, kb, vb = kv.gather("r0", lay)
        assert torch.equal(pa, pb) and torch.equal(ka, kb) and torch.equal(va, vb)
    kv.prefix.audit()
    eng.abort("r0")
    eng.scheduler.preempt(eng._seqs["r1"])                                # references go with them
    assert next(iter(kv.prefix.snapshots.values())).refs == 0
    kv.prefix.audit()
    while eng.has_unfinished():
        eng.step()
    kv.prefix.audit()


def test_shared_pages_cannot_be_released():
    bm = BlockManager(2, 4, 4, 64, {p: 100 for p in BITS}, {p: 64 for p in BITS}, 1 << 20)
    cache = PrefixCache(bm, "k")
    bm.add("a")
    for layer in range(2):
        bm.append(0, layer, Precision.HIGH, torch.arange(9))
    bm.next_position[0] = 9
    cache.register("a", list(range(9)), 9)
    assert int(bm.shared_pages[0]) == 2
    with pytest.raises(ValueError, match="read-only"):
        bm.release_one(torch.tensor([0]), torch.tensor([1]), torch.tensor([3]))
    with pytest.raises(ValueError, match="read-only"):
        bm.remove(0, 0, Precision.HIGH, torch.tensor([7]))
    bm.release_one(torch.tensor([0]), torch.tensor([1]), torch.tensor([8]))   # a private entry: fine
    cache.audit()


def test_accounting_recounts_after_random_operations():
    """Random admissions (four prefixes), appends, caching, releases, evictions and invalidations on
    a small pool; after every operation the references, pages and bytes recount exactly."""
    rng = random.Random(0)
    L, bs = 3, 4
    bm = BlockManager(L, bs, 6, 64, {p: 10 for p in BITS}, {p: 40 for p in BITS}, 10 * 39 * 3)
    cache = PrefixCache(bm, "v1")
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 30))] for _ in range(4)]
    live: dict[str, list[int]] = {}
    hits = 0
    for step in range(400):
        op = rng.random()
        if op < 0.35 and len(live) < 6:
            sid = f"s{step}"
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
            bm.add(sid)
            start = cache.attach(sid, tokens)
            hits += start
            try:
                for layer in range(L):
                    bm.append(bm.rows[sid], layer, Precision.HIGH, torch.arange(start, len(tokens)))
            except KVCacheOutOfMemory:
                cache.release(sid)
                bm.free(sid)
                continue
            bm.next_position[bm.rows[sid]] = len(tokens)
            cache.register(sid, tokens, len(tokens))
            live[sid] = tokens
        elif op < 0.75 and live:
            sid = rng.choice(sorted(live))
            del live[sid]
            cache.release(sid)
            bm.free(sid)
        elif op < 0.8:
            cache.set_key(f"v{step}")
        elif op < 0.9:
            cache.evict(rng.randrange(1, 10))
        cache.audit()
        assert bm.bytes_used <= bm.max_bytes
    assert hits > 0 and cache.hits == hits


def test_pask_compressed_sharing_under_random_operations(same_state_prompts, shared_prompts):
    """300 random operations on PASK with the cache, in a pool that preempts and evicts: requests
    from two prefix families, steps, aborts, preemptions, a replica budget that falls and rises
    (demotions copy shared pages on write) and a table publication. After every operation the
    references, pages and bytes recount, and every sequence holds at most its budget."""
    rng = random.Random(1)
    eng = _cached(kv_policy="pask", kv_budget=0.33, kv_cache_bytes=6 << 20)
    prompts = same_state_prompts + [p[:200] + [rng.randrange(4, 4000)] for p in shared_prompts[:2]]
    kv, n = eng.kv, 0
    for _ in range(300):
        op = rng.random()
        if op < 0.3 and len(eng._seqs) < 6:
            eng.add_request(f"q{n}", rng.choice(prompts), SamplingParams(max_tokens=rng.randrange(1, 30), ignore_eos=True))
            n += 1
        elif op < 0.8:
            eng.step()
        elif op < 0.85 and eng._seqs:
            eng.abort(rng.choice(list(eng._seqs)))
        elif op < 0.9 and eng.scheduler.running:
            eng.scheduler.preempt(rng.choice(eng.scheduler.running))
        elif op < 0.98:
            eng.set_replica_budget(rng.choice([1.0, 0.3, 0.25]))   # a request's budget: min(its own, the replica's)
        else:
            kv.prefix.set_key(("publication", n))
        kv.prefix.audit()
        for rid, seq in eng._seqs.items() if 0.3 <= op < 0.8 else ():   # a new budget holds from the next step
            if rid in kv.seqs and seq.prefilled:
                assert kv.sequence_bytes(rid) <= seq.kv_budget * kv.full_kv_bytes(seq.num_tokens) + 1e-6
    assert kv.prefix.compressed_hits > 0 and kv.blocks.num_unshared_pages > 0
    while eng.has_unfinished():
        eng.step()
        kv.prefix.audit()
    assert eng.stats()["kv_bytes_used"] == 0


def test_pask_publication_and_an_abort_mid_prefill(same_state_prompts):
    """A table publication drops PASK's compressed prefixes (a referenced one is freed after its
    last row); a prompt aborted mid-prefill caches only the whole pages of completed forwards, and
    its shadow goes with it."""
    eng = _cached(kv_policy="pask", kv_budget=0.33, enable_chunked_prefill=True, max_num_batched_tokens=72)
    eng.add_request("a", same_state_prompts[0], GREEDY)
    eng.step()                                                           # 72 tokens: 4 whole pages cached
    assert len(eng.kv.prefix.table) == 4 and eng.kv.shadow_of("a") is not None
    eng.abort("a")
    assert eng.kv.shadow_of("a") is None and not eng.kv.seqs
    eng.kv.prefix.audit()
    eng.generate(same_state_prompts[:1], GREEDY)
    eng.add_request("b", same_state_prompts[1], SamplingParams(max_tokens=30, ignore_eos=True))
    while not eng._seqs["b"].prefilled:
        eng.step()
    snap = eng.kv.prefix.seq_snapshot["b"]
    eng.kv.prefix.set_key("v2")
    assert snap.stale and not eng.kv.prefix.snapshots and eng.kv.prefix.peek(same_state_prompts[2]) == (0, 0)
    eng.kv.prefix.audit()
    while eng.has_unfinished():
        eng.step()
    assert eng.stats()["kv_bytes_used"] == 0 and eng.kv.bytes_used == 0   # the stale prefix went back
    eng.kv.prefix.audit()
