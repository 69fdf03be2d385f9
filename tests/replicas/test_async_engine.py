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
