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


def test_policies_that_release_prompt_entries_are_refused():
    with pytest.raises(ValueError, match="enable_prefix_caching supports kv_policy 'full' only, not 'pask'"):
        LLMEngine(EngineConfig(kv_policy="pask", kv_budget=0.33, enable_prefix_caching=True))


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
