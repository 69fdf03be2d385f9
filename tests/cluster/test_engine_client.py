"""The ingress side of a replica failure (cluster.app.EngineClient) against a scripted handle: retry
before anything came back, 503 with Retry-After when retries run out, a final SSE error event once a
stream has started, cancellation when the client goes away, replica-side APIErrors passed through."""

import asyncio
import json

import pytest
from fastapi.testclient import TestClient
from ray.exceptions import ActorDiedError

from cluster.app import EngineClient
from cluster.openai_api import APIError, build_app
from cluster.protocol import Limits

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


class ScriptedHandle:
    """Each call plays the next script: a list of items, where an exception item is raised."""

    def __init__(self, *scripts):
        self.scripts, self.calls, self.cancelled = list(scripts), [], 0

    def options(self, stream: bool, method_name: str):
        assert stream
        self.method = method_name
        return self

    def remote(self, req):
        self.calls.append(self.method)
        return _Gen(self, self.scripts.pop(0))


class _Gen:
    def __init__(self, handle, script):
        self.handle, self.script = handle, list(script)

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0)
        if not self.script:
            raise StopAsyncIteration
        item = self.script.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self):
        self.handle.cancelled += 1


def _client(handle, retries=1):
    return EngineClient(handle, "m", Limits(), None, retries)


def test_a_request_that_got_nothing_is_retried_on_another_replica():
    handle = ScriptedHandle([ActorDiedError()], [{"id": "x", "choices": []}])
    r = TestClient(build_app(_client(handle))).post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and r.json()["id"] == "x"
    assert handle.calls == ["chat", "chat"]


def test_retries_run_out_503_with_retry_after():
    handle = ScriptedHandle([ActorDiedError()], [ActorDiedError()])
    r = TestClient(build_app(_client(handle))).post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["type"] == "service_unavailable" and "ActorDiedError" in r.json()["error"]["message"]
    assert handle.calls == ["completion", "completion"]
    handle = ScriptedHandle([ActorDiedError()])
    assert TestClient(build_app(_client(handle, retries=0))).post("/v1/chat/completions", json=CHAT).status_code == 503


def test_a_stream_cut_by_a_replica_failure_ends_with_an_error_event():
    handle = ScriptedHandle(['data: {"a": 1}\n\n', 'data: {"a": 2}\n\n', ActorDiedError()])
    r = TestClient(build_app(_client(handle))).post("/v1/chat/completions", json={**CHAT, "stream": True})
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[:2] == ['{"a": 1}', '{"a": 2}'] and len(events) == 3
    assert json.loads(events[2])["error"]["code"] == 503
    assert handle.calls == ["chat"]  # a started stream is not replayed


def test_replica_errors_pass_through_and_a_consumer_that_stops_cancels():
    handle = ScriptedHandle([APIError(400, "bad schema", param="response_format")])
    r = TestClient(build_app(_client(handle))).post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"

    async def stop_early():
        handle = ScriptedHandle(["data: 1\n\n", "data: 2\n\n", "data: 3\n\n"])
        items = _client(handle).open("chat", None)
        assert await items.__anext__() == "data: 1\n\n"
        await items.aclose()
        return handle.cancelled
    assert asyncio.run(stop_early()) == 1


def test_api_error_survives_pickling():
    import pickle
    e = pickle.loads(pickle.dumps(APIError(429, "full", "rate_limit_error", None, {"Retry-After": "1"})))
    assert (e.status, e.message, e.type, e.headers) == (429, "full", "rate_limit_error", {"Retry-After": "1"})


@pytest.mark.parametrize("dead", [True, False])
def test_health_is_503_when_no_replica_answers(dead):
    class Handle:
        class health:
            @staticmethod
            async def remote():
                if dead:
                    raise ActorDiedError()
    r = TestClient(build_app(EngineClient(Handle(), "m", Limits(), None))).get("/health")
    assert r.status_code == (503 if dead else 200)


def test_a_replica_bug_is_a_500_in_the_envelope_or_an_error_event():
    from ray.exceptions import RayTaskError
    bug = RayTaskError("chat", "Traceback ...", KeyError("x"))
    r = TestClient(build_app(_client(ScriptedHandle([bug]))), raise_server_exceptions=False).post(
        "/v1/chat/completions", json=CHAT)
    assert r.status_code == 500 and r.json()["error"]["type"] == "internal_server_error"
    r = TestClient(build_app(_client(ScriptedHandle(['data: {"a": 1}\n\n', bug])))).post(
        "/v1/chat/completions", json={**CHAT, "stream": True})
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[-1])["error"]["code"] == 500


def test_replica_errors_arrive_as_items_not_exceptions():
    """LLMServer yields a request error as an item (Ray Serve would log a raised 4xx as a failed
    call with its traceback); the ingress turns it back into the same response."""
    import asyncio as _asyncio

    from cluster.app import _API_ERROR, _errors_as_items

    async def fails():
        raise APIError(400, "bad schema", param="response_format")
        yield  # an async generator

    async def collect():
        return [x async for x in _errors_as_items(fails())]
    (item,) = _asyncio.run(collect())
    r = TestClient(build_app(_client(ScriptedHandle([item])))).post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 400 and r.json()["error"] == {"message": "bad schema", "type": "invalid_request_error",
                                                          "param": "response_format", "code": 400}
    late = {_API_ERROR: [503, "engine step failed", "service_unavailable", None, None]}
    r = TestClient(build_app(_client(ScriptedHandle(['data: {"a": 1}\n\n', late])))).post(
        "/v1/chat/completions", json={**CHAT, "stream": True})
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert len(events) == 2 and json.loads(events[1])["error"]["code"] == 503
