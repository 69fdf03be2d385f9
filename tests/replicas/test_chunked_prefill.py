"""Chunked and batched prefill: same tokens and decisions as whole-prompt prefill, running streams
not stalled by a long prompt, several prompts in one forward, abort and preemption mid-prompt."""

import math

import pytest

from replicas.config import EngineConfig
from replicas.engine import LLMEngine
from replicas.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


def _chunked(**kw) -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_bytes=64 << 20, max_num_seqs=8, enable_chunked_prefill=True,
                                  max_num_batched_tokens=kw.pop("max_num_batched_tokens", 96), **kw))


def _kept(engine: LLMEngine, rid: str) -> list[dict]:
    return [engine.kv.kept(rid, layer) for layer in range(engine.kv.cfg.num_layers)]


def test_full_kv_tokens_equal_whole_prompt_prefill(engine, chat_prompts):
    prompts = chat_prompts[:4]
    assert min(map(len, prompts)) > 96          # every prompt takes several chunks
    want = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    chunked = _chunked()
    assert [o.token_ids for o in chunked.generate(prompts, GREEDY)] == want
    assert chunked.kv.bytes_used == 0


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "compilerkv+pask", "streaming_llm"])
def test_compression_at_the_end_of_the_prompt_keeps_the_same_entries(chat_prompts, policy):
    """A prompt prefilled in chunks of 96 tokens is compressed when its last chunk is in, from
    the same window queries (H2O: every prompt query), so each layer keeps the same positions at
    the same precisions as after a whole-prompt prefill."""
    prompt = chat_prompts[1]
    args = dict(kv_policy=policy, kv_budget=0.33, kv_cache_bytes=64 << 20, max_num_seqs=8)
    whole, chunked = LLMEngine(EngineConfig(**args)), _chunked(**{k: v for k, v in args.items() if k not in ("kv_cache_bytes", "max_num_seqs")})
    kept = []
    for eng in (whole, chunked):
        eng.add_request("r", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
        while not eng._seqs["r"].prefilled:
            eng.step()
        kept.append(_kept(eng, "r"))
    assert kept[0] == kept[1]
    assert sum(map(len, kept[0])) < 0.5 * len(prompt) * whole.kv.cfg.num_layers   # it did compress


def test_pask_stores_each_chunk_at_its_targets_and_stays_within_budget_plus_a_chunk(chat_prompts):
    prompt = chat_prompts[1]
    eng = _chunked(kv_policy="pask", kv_budget=0.33)
    eng.add_request("r", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    seq, kv = eng._seqs["r"], eng.kv
    # one chunk at HIGH, plus a partly filled page per layer in each of the three pools
    slack = kv.full_kv_bytes(96) + kv.cfg.num_layers * sum(kv.page_cost(p) for p in kv.pools)
    peak = 0
    while not seq.prefilled:
        eng.step()
        peak = max(peak, kv.sequence_bytes("r"))
    assert peak <= seq.kv_budget * kv.full_kv_bytes(seq.num_tokens) + slack
    whole = LLMEngine(EngineConfig(kv_policy="pask", kv_budget=0.33, kv_cache_bytes=64 << 20))
    whole.add_request("r", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    whole.step()
    assert _kept(eng, "r") == _kept(whole, "r")      # the same table decisions, position by position


def test_running_streams_decode_in_every_step_while_a_long_prompt_is_prefilled(chat_prompts):
    eng = _chunked(max_num_batched_tokens=64)
    eng.add_request("running", chat_prompts[0][:60], SamplingParams(max_tokens=40, ignore_eos=True))
    eng.step()                                          # its whole prompt fits one chunk
    long = chat_prompts[2]
    eng.add_request("long", long, SamplingParams(max_tokens=2, ignore_eos=True))
    steps, advanced = 0, 0
    while not eng._seqs["long"].prefilled:
        before = len(eng._seqs["running"].output_token_ids)
        eng.step()
        steps += 1
        advanced += len(eng._seqs["running"].output_token_ids) > before
    assert steps == -(-len(long) // 63)                 # 64 tokens a step, one of them the stream's
    assert advanced == steps                            # a token for the stream in every step
    whole = LLMEngine(EngineConfig(kv_cache_bytes=64 << 20, max_num_batched_tokens=64))
    whole.add_request("running", chat_prompts[0][:60], SamplingParams(max_tokens=40, ignore_eos=True))
    whole.step()
    whole.add_request("long", long, SamplingParams(max_tokens=2, ignore_eos=True))
    before = len(whole._seqs["running"].output_token_ids)
    whole.step()                                        # without chunking: the whole prompt first
    assert len(whole._seqs["running"].output_token_ids) == before and whole._seqs["long"].prefilled


def test_mixed_steps_give_the_same_tokens(engine, chat_prompts):
    """Requests arriving while others decode: with chunked prefill their chunks share forwards
    with the decode batch; every request's greedy tokens equal its solo run."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    solo = [engine.generate([p], params)[0].token_ids for p in chat_prompts[:3]]
    eng = _chunked(max_num_batched_tokens=80)
    got = {}
    for i in range(200):
        if i in (0, 2, 5):
            eng.add_request(f"r{(0, 2, 5).index(i)}", chat_prompts[(0, 2, 5).index(i)], params)
        for out in eng.step():
            if out.finished:
                got[out.request_id] = out.token_ids
        if len(got) == 3:
            break
    assert [got[f"r{i}"] for i in range(3)] == solo
    assert eng.kv.bytes_used == 0


def test_several_prompts_share_one_prefill_forward(engine, chat_prompts, monkeypatch):
    prompts = chat_prompts[:5]
    calls = []
    real = engine.runner.forward
    monkeypatch.setattr(engine.runner, "forward", lambda seqs, plan, chunks, *a: calls.append(len(chunks)) or real(seqs, plan, chunks, *a))
    outs = engine.generate(prompts, GREEDY)
    assert calls[0] == 5                                # every prompt in the first forward
    solo = [engine.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert [o.token_ids for o in outs] == solo


def test_abort_and_preemption_mid_prompt_leave_nothing_behind(chat_prompts):
    eng = _chunked()
    eng.add_request("a", chat_prompts[2], GREEDY)
    eng.step()
    seq = eng._seqs["a"]
    assert 0 < seq.num_computed_tokens < seq.num_tokens and eng.kv.bytes_used > 0
    eng.abort("a")
    assert eng.kv.bytes_used == 0 and not eng.has_unfinished()
    eng.add_request("b", chat_prompts[2], GREEDY)
    eng.step()
    seq = eng._seqs["b"]
    eng.scheduler.preempt(seq)
    assert (seq.num_computed_tokens, seq.prefilled, seq.prefill_state) == (0, False, None)
    assert eng.kv.bytes_used == 0
    last = None
    while eng.has_unfinished():        # recomputed from the start
        last = (eng.step() or [last])[-1]
    assert last.finished and eng.kv.bytes_used == 0
    assert last.token_ids == LLMEngine(EngineConfig(kv_cache_bytes=64 << 20)).generate([chat_prompts[2]], GREEDY)[0].token_ids


def test_admission_counts_the_transient_of_every_prompt_in_one_forward(chat_prompts):
    """Prompts prefilled in one forward are at full size together before they are compressed: a
    pool of 1.5 full prompts at budget 0.33 must not admit two into one forward (that ran out of
    pages inside the forward, preempted both, and admitted them again: a livelock)."""
    prompt = chat_prompts[1]
    probe = LLMEngine(EngineConfig(kv_cache_bytes=64 << 20))
    full = probe.kv.full_kv_bytes(len(prompt) + 8)
    eng = LLMEngine(EngineConfig(kv_policy="snapkv", kv_budget=0.33, kv_cache_bytes=int(1.5 * full) + (1 << 16)))
    for i in range(3):
        eng.add_request(f"r{i}", prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    outs, steps = {}, 0
    while eng.has_unfinished() and steps < 200:
        steps += 1
        for out in eng.step():
            if out.finished:
                outs[out.request_id] = out
    assert len(outs) == 3 and steps < 200
    assert sum(o.metrics.num_preemptions for o in outs.values()) == 0


def test_streaming_llm_compresses_every_chunk_and_admission_counts_one_chunk(chat_prompts):
    """StreamingLLM's scores depend on positions only, so the prompt is brought to its end-of-prompt
    set after every chunk (PASK stores every chunk at its targets): it never holds more than its budget plus one chunk between steps, and
    admission counts one chunk per prompt instead of the whole prompt: in a pool that holds four
    compressed prompts and a chunk, four run at once, where SnapKV (compressed only when the
    prompt is whole) runs three."""
    prompts = [p for p in chat_prompts if len(p) > 700][:4]
    assert len(prompts) == 4
    probe = _chunked(kv_policy="streaming_llm", kv_budget=0.33)
    assert probe.policy.spec.compresses_chunks and probe.scheduler.cfg.compresses_chunks
    kv = probe.kv
    slack = kv.full_kv_bytes(kv.cfg.block_size)   # one page per layer
    # Four compressed prompts, one chunk and some room to grow; not three compressed and one whole.
    compressed = [math.ceil(0.33 * kv.full_kv_bytes(len(p))) for p in prompts]
    pool = sum(compressed) + kv.full_kv_bytes(192 + 16) + kv.full_kv_bytes(160)
    assert pool < sum(compressed) - max(compressed) + min(kv.full_kv_bytes(len(p)) for p in prompts)
    running = {}
    for policy in ("streaming_llm", "pask", "snapkv"):
        eng = LLMEngine(EngineConfig(kv_cache_bytes=pool, max_num_seqs=8, enable_chunked_prefill=True,
                                     max_num_batched_tokens=192, kv_policy=policy, kv_budget=0.33))
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, SamplingParams(max_tokens=32, ignore_eos=True))
        most, worst = 0, 0.0
        while eng.has_unfinished():
            eng.step()
            most = max(most, len(eng.scheduler.running))
            for seq in eng.scheduler.running:
                if policy != "snapkv":   # between steps: within the budget of the whole prompt
                    allowed = seq.kv_budget * eng.kv.full_kv_bytes(seq.num_tokens) + slack
                    worst = max(worst, eng.kv.sequence_bytes(seq.request_id) / allowed)
        running[policy] = most
        assert eng.kv.bytes_used == 0
        if policy != "snapkv":
            assert worst <= 1.0, (policy, worst)
    assert running == {"streaming_llm": 4, "pask": 4, "snapkv": 3}, running
