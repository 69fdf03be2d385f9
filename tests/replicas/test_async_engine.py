"""The async streaming wrapper: streams, runs requests concurrently, aborts on disconnect."""

import asyncio

import pytest

from replicas.async_engine import AsyncLLMEngine
from replicas.errors import InvalidRequestError
from replicas.sampling_params import SamplingParams


@pytest.fixture
def async_engine(engine):
    # The wrapper's thread owns the engine while it runs: no synchronous use meanwhile.
    a = AsyncLLMEngine(engine)
    yield a
    a.shutdown()


@pytest.fixture
def want(engine, chat_prompts):
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    return [o.token_ids for o in engine.generate(chat_prompts[:2], params)]


def test_stream_concurrent_and_disconnect(want, async_engine, engine, chat_prompts):
    params = SamplingParams(max_tokens=8, ignore_eos=True)

    async def collect(prompt):
        outs = [o async for o in async_engine.generate(prompt, params)]
        assert all(not o.finished for o in outs[:-1]) and outs[-1].finished
        assert [o.num_output_tokens for o in outs] == list(range(1, 9))
        assert all(len(o.new_token_ids) == 1 for o in outs)   # deltas: each token once
        assert [t for o in outs for t in o.new_token_ids] == outs[-1].token_ids
        assert "".join(o.new_text for o in outs) == outs[-1].text
        return outs[-1].token_ids

    async def disconnect():
        stream = async_engine.generate(chat_prompts[2], SamplingParams(max_tokens=200))
        async for out in stream:
            if out.num_output_tokens >= 2:
                break  # the client goes away
        await stream.aclose()

    async def main():
        got = await asyncio.gather(collect(chat_prompts[0]), collect(chat_prompts[1]), disconnect())
        return got[:2]
    assert asyncio.run(main()) == want
    assert engine.kv.bytes_used == 0 and not engine.has_unfinished()


def test_bad_request_raises_before_streaming(async_engine):
    async def main():
        async for _ in async_engine.generate([], SamplingParams(max_tokens=2)):
            pass
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        asyncio.run(main())


def test_ping_goes_through_the_engine_loop(async_engine, chat_prompts):
    """The health probe is answered between steps; a loop held inside a step fails it; a stopped
    loop fails it at once."""
    import threading

    from replicas.async_engine import EngineDeadError

    async def ping_while_generating():
        params = SamplingParams(max_tokens=16, ignore_eos=True)
        gen = async_engine.generate(chat_prompts[0], params)
        await gen.__anext__()
        await async_engine.ping(10)  # answered while a request is running
        async for _ in gen:
            pass
    asyncio.run(ping_while_generating())

    held, release = threading.Event(), threading.Event()
    step = async_engine.engine.step

    def stuck_step():
        held.set()
        release.wait(30)
        return step()
    async_engine.engine.step = stuck_step

    async def ping_stuck():
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        gen = async_engine.generate(chat_prompts[0], params)
        task = asyncio.ensure_future(gen.__anext__())
        while not held.is_set():
            await asyncio.sleep(0.01)
        with pytest.raises(EngineDeadError, match="did not come round"):
            await async_engine.ping(0.3)
        release.set()
        await task
        async for _ in gen:
            pass
    try:
        asyncio.run(ping_stuck())
    finally:
        async_engine.engine.step = step
        release.set()
    async_engine.shutdown()
    with pytest.raises(EngineDeadError, match="not running"):
        asyncio.run(async_engine.ping(1))


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
          "additionalProperties": False}


def _blocked_compiles(monkeypatch, engine):
    """Make every grammar compile wait on an event (``entered`` set once one is waiting)."""
    import threading
    compiler = engine.grammar
    real, entered, gate = compiler.matcher, threading.Event(), threading.Event()

    def blocked(spec):
        entered.set()
        assert gate.wait(60), "the test never released the compile"
        return real(spec)
    monkeypatch.setattr(compiler, "matcher", blocked)
    return entered, gate


def test_compile_does_not_stop_other_streams(async_engine, engine, chat_prompts, monkeypatch):
    """While a grammar's compile is blocked, a running stream gets all its tokens and finishes;
    once released, the grammar request is served under its grammar."""
    import json

    from replicas.grammar import GrammarSpec
    entered, gate = _blocked_compiles(monkeypatch, engine)

    async def main():
        constrained = async_engine.generate(chat_prompts[1], SamplingParams(max_tokens=32),
                                            grammar=GrammarSpec("json_schema", SCHEMA))
        first = asyncio.ensure_future(constrained.__anext__())
        while not entered.is_set():
            await asyncio.sleep(0.01)
        n = 0
        async for out in async_engine.generate(chat_prompts[0], SamplingParams(max_tokens=12, ignore_eos=True)):
            n += len(out.new_token_ids)
        assert n == 12 and not first.done()   # the other stream ran to its end during the compile
        gate.set()
        outs = [await first] + [o async for o in constrained]
        return outs[-1]
    last = asyncio.run(main())
    assert last.finish_reason == "stop" and isinstance(json.loads(last.text)["city"], str)
    assert engine.kv.bytes_used == 0 and not engine.has_unfinished() and not engine._seqs


def test_abort_while_compiling_leaves_nothing(async_engine, engine, chat_prompts, monkeypatch):
    """A consumer that goes away while its grammar compiles: the request is dropped (no sequence,
    no KV, no queue), the compile finishes into the cache, and the engine serves the next request."""
    from replicas.grammar import GrammarSpec
    entered, gate = _blocked_compiles(monkeypatch, engine)
    spec = GrammarSpec("json_schema", {**SCHEMA, "title": "abort-while-compiling"})

    async def main():
        task = asyncio.ensure_future(anext_of(async_engine.generate(chat_prompts[1], SamplingParams(max_tokens=8),
                                                                     grammar=spec)))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        assert len(engine._seqs) == 1 and not engine.has_unfinished()   # held, not scheduled
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not engine._seqs and not async_engine._queues
        gate.set()
        outs = [o async for o in async_engine.generate(chat_prompts[0], SamplingParams(max_tokens=4, ignore_eos=True))]
        return outs[-1]

    async def anext_of(gen):
        try:
            return await gen.__anext__()
        finally:
            await gen.aclose()
    assert asyncio.run(main()).num_output_tokens == 4
    assert engine.kv.bytes_used == 0 and not engine._seqs


def test_compile_error_raises_before_streaming(async_engine, engine, chat_prompts):
    """A grammar that does not compile raises GrammarCompileError (an InvalidRequestError, HTTP
    400 in the API) from the first ``__anext__``, as before, and leaves nothing behind."""
    from replicas.errors import GrammarCompileError
    from replicas.grammar import GrammarSpec

    async def main():
        async for _ in async_engine.generate(chat_prompts[0], SamplingParams(max_tokens=4),
                                             grammar=GrammarSpec("regex", "(unclosed")):
            pass
    with pytest.raises(GrammarCompileError) as e:
        asyncio.run(main())
    assert isinstance(e.value, InvalidRequestError)
    assert not engine._seqs and not async_engine._queues and engine.kv.bytes_used == 0


def test_failed_step_while_compiling_reaches_the_held_request(async_engine, engine, chat_prompts, monkeypatch):
    """A step that fails while a grammar compiles ends the held request with EngineDeadError once
    its compile is done (not a stream that ends with nothing)."""
    from replicas.async_engine import EngineDeadError
    from replicas.grammar import GrammarSpec
    entered, gate = _blocked_compiles(monkeypatch, engine)

    def broken():
        raise RuntimeError("boom")

    async def main():
        held = async_engine.generate(chat_prompts[1], SamplingParams(max_tokens=4),
                                     grammar=GrammarSpec("json_schema", {**SCHEMA, "title": "failed-step"}))
        task = asyncio.ensure_future(held.__anext__())
        while not entered.is_set():
            await asyncio.sleep(0.01)
        engine.step = broken
        try:
            with pytest.raises(EngineDeadError, match="boom"):
                async for _ in async_engine.generate(chat_prompts[0], SamplingParams(max_tokens=4)):
                    pass
        finally:
            del engine.step
        gate.set()
        with pytest.raises(EngineDeadError, match="boom"):
            await task
    asyncio.run(main())
    assert not engine._seqs and not async_engine._queues and engine.kv.bytes_used == 0
