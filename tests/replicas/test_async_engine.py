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
        assert [len(o.token_ids) for o in outs] == list(range(1, 9))
        return outs[-1].token_ids

    async def disconnect():
        stream = async_engine.generate(chat_prompts[2], SamplingParams(max_tokens=200))
        async for out in stream:
            if len(out.token_ids) >= 2:
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
