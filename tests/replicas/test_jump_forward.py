"""Jump-forward decoding: forced tokens appended without decode steps, the same greedy outputs as
decoding every token, retokenization held back at the boundary, every KV policy served."""

import pytest

from bench.accuracy import load_items
from replicas.config import EngineConfig
from replicas.engine import LLMEngine
from replicas.grammar import GrammarSpec
from replicas.jump_forward import ForcedTokenizer, forced_tokens
from replicas.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=64)


@pytest.fixture(scope="module")
def tool_requests(engine):
    items = [i for c in ("simple", "multiple") for i in load_items("test", [c])[:2]]
    return [(engine.tokenizer.apply_chat_template(i.messages, tools=i.tools, add_generation_prompt=True,
                                                  return_dict=True)["input_ids"],
             GrammarSpec("tools", {"tools": i.tools, "tool_choice": "auto"})) for i in items]


def _run(requests, **cfg):
    """Generate every request; per request (token ids, forced tokens, sampled tokens, KV kept per
    layer when it finished), and the engine steps it took."""
    eng = LLMEngine(EngineConfig(kv_cache_bytes=64 << 20, max_num_seqs=8, **cfg))
    kept, finish = {}, eng._finish

    def record(seq, reason):   # the KV as the sequence ends (every token's but the last sampled one)
        if seq.request_id in eng.kv.seqs:
            kept[seq.request_id] = [eng.kv.kept(seq.request_id, l) for l in range(eng.kv.cfg.num_layers)]
        finish(seq, reason)
    eng._finish = record
    for i, (ids, spec) in enumerate(requests):
        eng.add_request(str(i), ids, PARAMS, spec)
    outs, steps = {}, 0
    while eng.has_unfinished():
        steps += 1
        for out in eng.step():
            budget = eng._seqs[out.request_id].kv_budget if out.request_id in eng._seqs else 1.0
            if out.request_id in eng.kv.seqs and budget < 1.0:   # the budget guarantee, every step
                assert eng.kv.sequence_bytes(out.request_id) <= budget * eng.kv.full_kv_bytes(
                    eng._seqs[out.request_id].num_tokens) + 1e-6
            if out.finished:
                outs[out.request_id] = out
    res = [(outs[str(i)].token_ids, outs[str(i)].metrics.num_forced_tokens, outs[str(i)].metrics.num_steps,
            kept.get(str(i))) for i in range(len(requests))]
    return eng, res, steps


def test_forced_tokens_take_no_decode_step_and_outputs_equal(tool_requests):
    _, off, off_steps = _run(tool_requests)
    eng, on, on_steps = _run(tool_requests, enable_jump_forward=True)
    assert eng.jump_forward
    assert [r[0] for r in on] == [r[0] for r in off]              # same greedy tokens
    assert all(r[1] == 0 and r[2] == len(r[0]) for r in off)      # one step per token without it
    for tokens, forced, sampled, _ in on:
        assert sampled == len(tokens) - forced                    # forced tokens: no step of their own
    assert sum(r[1] for r in on) > 0
    assert sum(r[2] for r in on) < 0.7 * sum(r[2] for r in off)   # >= 30 % fewer decode steps
    assert on_steps < off_steps


@pytest.mark.parametrize("policy", ["pask", "compilerkv+pask"])
def test_policies_taking_chunks_store_forced_tokens_as_decoding_does(tool_requests, policy):
    """PASK stores each forced token at its tag's targets, as a decode step would: the same
    generated positions at the same precisions in every layer when the sequence ends (PASK: the
    prompt's entries too). compilerkv+pask's prompt side gives back prompt pages when the budget
    is checked, once a step: without jump-forward that is once per token, with it once per forced
    run, so it may give back a page less (measured: 464 vs 480 prompt entries kept on one prompt,
    both within budget); the budget itself is checked after every step in ``_run``."""
    _, off, _ = _run(tool_requests[:2], kv_policy=policy, kv_budget=0.33)
    eng, on, _ = _run(tool_requests[:2], kv_policy=policy, kv_budget=0.33, enable_jump_forward=True)
    assert eng.jump_forward and all(r[1] > 0 for r in on)
    same = [(n, a, b) for (ids, _), a, b in zip(tool_requests, off, on) if a[0] == b[0] for n in [len(ids)]]
    assert same                                                   # the comparison is not empty
    for n, a, b in same:
        generated = lambda kept: [{p: v for p, v in layer.items() if p >= n} for layer in kept]  # noqa: E731
        assert generated(a[3]) == generated(b[3]) and any(generated(b[3]))
        if policy == "pask":
            assert a[3] == b[3]


@pytest.mark.parametrize("policy", ["snapkv", "streaming_llm"])
def test_per_step_policies_fall_back_to_decoding(tool_requests, policy):
    """Scoring policies evict per decode step: forced tokens are decoded one step each (the
    setting is off for them), outputs as without it."""
    _, off, _ = _run(tool_requests[:2], kv_policy=policy, kv_budget=0.33)
    eng, on, _ = _run(tool_requests[:2], kv_policy=policy, kv_budget=0.33, enable_jump_forward=True)
    assert not eng.jump_forward
    assert [r[0] for r in on] == [r[0] for r in off] and all(r[1] == 0 for r in on)


def test_full_kv_serves_the_setting(tool_requests):
    eng, on, _ = _run(tool_requests[:1], kv_policy="full", enable_jump_forward=True)
    assert eng.jump_forward and on[0][1] > 0


def test_boundary_piece_is_held_back(engine):
    """``": {`` alone tokenizes as ``'":' ' ' '{'``, but before ``"city"`` as ``'":' ' {"' ...``:
    the forced tokens stop before the last piece, so the model samples ``' {"'`` itself."""
    tok = engine.tokenizer
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    sampled = enc('{"name": "get_weather", "arguments')
    forced = '": {'
    alone, in_context = enc(forced), enc('{"name": "get_weather", "arguments": {"city')
    assert [tok.decode([t]) for t in alone][-2:] == [" ", "{"]            # differs at the boundary
    assert not set(alone[-2:]) & set(in_context)
    out = ForcedTokenizer(tok, engine._token_text)(sampled, forced)
    assert out and tok.decode(out) == '":'
    assert in_context[:len(sampled) + len(out)] == sampled + out       # the canonical tokens, exactly


def test_forced_tokens_stop_at_a_refused_token_and_at_the_limit(engine):
    class Matcher:   # accepts two tokens, then refuses
        def __init__(self):
            self.accepted = []

        def is_terminated(self):
            return False

        def find_jump_forward_string(self):
            return "forced"

        def accept_token(self, t):
            if len(self.accepted) < 2:
                self.accepted.append(t)
                return True
            return False
    assert forced_tokens(Matcher(), lambda s: [5, 6, 7, 8], 10) == [5, 6]
    assert forced_tokens(Matcher(), lambda s: [5, 6, 7, 8], 1) == [5]
    assert forced_tokens(Matcher(), lambda s: [5, 6], 0) == []


def test_sampled_outputs_equal_and_rejected_drafts_leave_no_kv(tool_requests):
    """Seeded sampling at temperature 1: each draft token is kept only where the request's own
    generator draws it, so the outputs equal decoding one step per token (the same draws in the
    same order), drafts are rejected on the way (the model often spells a forced text otherwise),
    and a rejected draft's KV is taken back: every layer keeps exactly the positions before the
    last sampled token, as without jump-forward."""
    params = SamplingParams(max_tokens=48, temperature=1.0, seed=7)

    def run(jump):
        eng = LLMEngine(EngineConfig(kv_cache_bytes=64 << 20, max_num_seqs=8, enable_jump_forward=jump))
        for i, (ids, spec) in enumerate(tool_requests):
            eng.add_request(str(i), ids, params, spec)
        outs = {}
        while eng.has_unfinished():
            for out in eng.step():
                seq = eng._seqs.get(out.request_id)
                if seq is not None and not seq.draft_token_ids:   # between drafts: the KV is the tokens'
                    for layer in range(eng.kv.cfg.num_layers):
                        assert sorted(eng.kv.kept(out.request_id, layer)) == list(range(seq.num_tokens - 1))
                if out.finished:
                    outs[out.request_id] = out
        return [outs[str(i)] for i in range(len(tool_requests))]

    off, on = run(False), run(True)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    drafted = sum(o.metrics.num_draft_tokens for o in on)
    kept = sum(o.metrics.num_forced_tokens for o in on)
    assert 0 < kept < drafted            # drafts were kept and drafts were rejected


def test_deltas_carry_kept_draft_tokens_and_add_up(tool_requests):
    """A step that keeps draft tokens reports them with the token it sampled, in one delta; the
    deltas add up to the whole output (tokens and text), and never hold an unverified draft."""
    eng = LLMEngine(EngineConfig(kv_cache_bytes=64 << 20, max_num_seqs=8, enable_jump_forward=True))
    ids, spec = tool_requests[0]
    eng.add_request("r", ids, PARAMS, spec)
    outs = []
    while eng.has_unfinished():
        for out in eng.step():
            seq = eng._seqs.get("r")
            if seq is not None:   # what was reported is output, the draft is not
                assert out.num_output_tokens == len(seq.output_token_ids)
            outs.append(out)
    last = outs[-1]
    assert last.finished and last.metrics.num_forced_tokens > 0
    assert max(len(o.new_token_ids) for o in outs) > 1
    assert [t for o in outs for t in o.new_token_ids] == last.token_ids
    assert "".join(o.new_text for o in outs) == last.text
