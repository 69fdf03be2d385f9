"""The engine loop: equality with transformers' greedy output, batching, preemption, abort,
stop conditions, seeded sampling, bad input."""

import pytest
import torch

from replicas.config import EngineConfig
from replicas.engine import LLMEngine
from replicas.errors import InvalidRequestError
from replicas.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def hf_greedy(engine):
    from transformers import AutoModelForCausalLM
    from models import resolve_checkpoint
    hf = AutoModelForCausalLM.from_pretrained(resolve_checkpoint(), dtype=torch.float32).eval()

    def run(ids, n):
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
        return out[0, len(ids):].tolist()
    return run


def test_greedy_equals_transformers_batched(engine, chat_prompts, hf_greedy):
    outs = engine.generate(chat_prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    for ids, out in zip(chat_prompts, outs):
        assert out.token_ids == hf_greedy(ids, 24)
        assert out.finish_reason == "length"
        assert out.metrics.kv_ratio_max == pytest.approx(1.0)
    assert engine.kv.bytes_used == 0


def test_requests_joining_mid_flight_match_solo_runs(engine, chat_prompts):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    solo = [engine.generate([p], params)[0].token_ids for p in chat_prompts[:3]]
    engine.add_request("late-0", chat_prompts[0], params)
    got = {}
    for i in range(40):
        if i == 3:
            engine.add_request("late-1", chat_prompts[1], params)
        if i == 6:
            engine.add_request("late-2", chat_prompts[2], params)
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.token_ids
    assert [got[f"late-{i}"] for i in range(3)] == solo


def test_preemption_recomputes_and_keeps_output(engine, chat_prompts):
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    prompts = [chat_prompts[0], chat_prompts[0][:-1], chat_prompts[0][:-2]]
    want = [o.token_ids for o in engine.generate(prompts, params)]
    # Room for all prompts at once, but not for all of them grown by 100 tokens.
    tight = LLMEngine(EngineConfig(kv_cache_bytes=int(engine.kv.full_kv_bytes(len(prompts[0]) + 100) * 1.6)))
    outs = tight.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert tight.kv.bytes_used == 0


def test_abort_frees_kv(engine, chat_prompts):
    engine.add_request("to-abort", chat_prompts[0], SamplingParams(max_tokens=50))
    engine.step()
    assert engine.kv.bytes_used > 0
    out = engine.abort("to-abort")
    assert out.finish_reason == "abort" and out.finished
    assert engine.kv.bytes_used == 0 and not engine.has_unfinished()
    assert engine.abort("to-abort") is None


def test_stop_string_and_eos(engine, chat_prompts):
    free = engine.generate([chat_prompts[0]], SamplingParams(max_tokens=40))[0]
    assert free.finish_reason in ("stop", "length")
    if len(free.text) > 4:
        stop = free.text[2:4]
        cut = engine.generate([chat_prompts[0]], SamplingParams(max_tokens=40, stop=(stop,)))[0]
        assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.find(stop)]


def test_seeded_sampling_is_reproducible(engine):
    prompt = list(range(100, 160))  # no chat context: the model is unsure, so seeds matter
    p = dict(max_tokens=16, temperature=1.0, top_p=0.9, ignore_eos=True)
    a = engine.generate([prompt], SamplingParams(seed=1, **p))[0].token_ids
    b = engine.generate([prompt], SamplingParams(seed=1, **p))[0].token_ids
    c = engine.generate([prompt], SamplingParams(seed=2, **p))[0].token_ids
    d = engine.generate([prompt], SamplingParams(seed=3, **p))[0].token_ids
    assert a == b
    assert len({tuple(a), tuple(c), tuple(d)}) > 1


def test_extreme_sampling_params_sample_the_top_token(engine):
    """Found by schemathesis: top_p 3e-237 (0 in float32) kept no token and multinomial raised inside
    the engine step, failing every request in the batch; a temperature of 1e-300 overflowed."""
    import torch

    from replicas.sampler import sample
    from replicas.sequence import Sequence
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    for params in (SamplingParams(temperature=0.1, top_p=3e-237), SamplingParams(temperature=1e-300)):
        seq = Sequence.__new__(Sequence)
        seq.params, seq.generator = params, None
        assert sample(logits, [seq], torch.Generator().manual_seed(0)) == [1]
    prompt = list(range(100, 120))
    greedy = engine.generate([prompt], SamplingParams(max_tokens=4))[0].token_ids
    for params in (SamplingParams(max_tokens=4, temperature=0.1, top_p=3e-237),
                   SamplingParams(max_tokens=4, temperature=1e-300)):
        assert engine.generate([prompt], params)[0].token_ids == greedy


@pytest.mark.parametrize("prompt,params,match", [
    ([], None, "prompt is empty"),
    ("", None, "prompt is empty"),
    ([1, 2, 99999], None, "outside"),
    ([1, -3], None, "outside"),
    ([5] * 4000, SamplingParams(max_tokens=200), "exceeds the context length"),
])
def test_bad_requests_are_refused_and_engine_keeps_serving(engine, chat_prompts, prompt, params, match):
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request("bad", prompt, params)
    assert engine.generate([chat_prompts[0]], SamplingParams(max_tokens=3))[0].finished


@pytest.mark.parametrize("kwargs,match", [(dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-1), "max_tokens"),
                                          (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p")])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


def test_duplicate_request_id(engine, chat_prompts):
    engine.add_request("dup", chat_prompts[0], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="already in flight"):
        engine.add_request("dup", chat_prompts[0])
    while engine.has_unfinished():
        engine.step()


def test_fast_detokenizer_equals_transformers_decode(engine):
    """The per-step text comes from the Rust tokenizer directly; it must equal transformers'
    ``decode`` (special tokens, byte fallback, partial UTF-8 sequences included)."""
    tok = engine.tokenizer
    g = torch.Generator().manual_seed(0)
    special = sorted(tok.all_special_ids)
    for n in (1, 2, 7, 64):
        for _ in range(20):
            ids = torch.randint(0, len(tok), (n,), generator=g).tolist()
            ids[0] = special[int(torch.randint(0, len(special), (1,), generator=g))] if n > 1 else ids[0]
            assert engine._detokenize(ids) == tok.decode(ids, skip_special_tokens=True)


def test_logprobs_are_the_models_distribution(engine, chat_prompts):
    """Each generated token's log-probability and its top-k alternatives equal log_softmax of
    transformers' logits at that step (greedy: the chosen token is the top one); under a grammar
    they are still the model's own distribution, not the masked one."""
    from transformers import AutoModelForCausalLM
    from models import resolve_checkpoint
    from replicas.grammar import GrammarSpec
    hf = AutoModelForCausalLM.from_pretrained(resolve_checkpoint(), dtype=torch.float32).eval()
    ids = chat_prompts[0]
    outs = engine.generate([ids, ids], SamplingParams(max_tokens=16, ignore_eos=True, logprobs=3),
                           grammars=[None, GrammarSpec("choice", ["zebra crossing"])])
    for out in outs:
        assert len(out.logprobs) == len(out.token_ids)
        with torch.no_grad():
            logits = hf(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1:-1]
        want = torch.log_softmax(logits.float(), -1)
        for step, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            assert entry.token_id == tok
            assert entry.logprob == pytest.approx(float(want[step, tok]), abs=1e-4)
            top_v, top_i = want[step].topk(3)
            assert [i for i, _ in entry.top] == top_i.tolist()
            assert [lp for _, lp in entry.top] == pytest.approx(top_v.tolist(), abs=1e-4)
    greedy, forced = outs
    assert all(e.top[0][0] == e.token_id for e in greedy.logprobs)
    assert forced.text == "zebra crossing"
    assert any(e.top[0][0] != e.token_id for e in forced.logprobs)   # the grammar overrode the model
    no = engine.generate([ids], SamplingParams(max_tokens=2))[0]
    assert no.logprobs is None
    with pytest.raises(InvalidRequestError, match="logprobs"):
        SamplingParams(logprobs=21)


def _deltas(engine, prompt, params, rid):
    engine.add_request(rid, prompt, params)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


@pytest.mark.parametrize("stop", [(), None])
def test_outputs_are_deltas_that_add_up_to_the_whole_output(engine, chat_prompts, stop):
    """Each step reports only its new token, text and log-probabilities (one token each, no
    copy of the earlier ones); they add up to the finished output's whole token ids, text and
    log-probabilities, which equal a full decode and ``generate()``'s answer. With a stop string
    (``None``: one taken from the free output) the held-back text still adds up."""
    free = engine.generate([chat_prompts[0]], SamplingParams(max_tokens=40, logprobs=2))[0]
    if stop is None:
        stop = (free.text[5:7],)
    params = SamplingParams(max_tokens=40, logprobs=2, stop=stop)
    outs = _deltas(engine, chat_prompts[0], params, f"deltas-{len(stop)}")
    last = outs[-1]
    assert last.finished and all(not o.finished for o in outs[:-1])
    assert all(o.token_ids is None and o.text is None and o.logprobs is None for o in outs[:-1])
    assert all(len(o.new_token_ids) == len(o.new_logprobs) == 1 for o in outs)
    assert [o.num_output_tokens for o in outs] == list(range(1, len(outs) + 1))
    assert [t for o in outs for t in o.new_token_ids] == last.token_ids
    assert [e for o in outs for e in o.new_logprobs] == last.logprobs
    assert "".join(o.new_text for o in outs) == last.text
    want = engine.generate([chat_prompts[0]], params)[0]
    assert (last.token_ids, last.text, last.logprobs) == (want.token_ids, want.text, want.logprobs)
    if stop:
        assert last.finish_reason == "stop" and last.text == free.text[: free.text.find(stop[0])]
    else:
        assert last.text == engine.tokenizer.decode(last.token_ids, skip_special_tokens=True)
        assert (last.token_ids, last.text) == (free.token_ids, free.text)
