"""The Ray Serve application end to end: build_app from the config's args, HTTP on loopback."""

import json

import httpx
import jsonschema
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def serve_url(ray_cluster):
    from ray import serve

    from cluster.app import build_app
    serve.start(http_options={"host": "127.0.0.1", "port": 8123})
    serve.run(build_app({"model": "models/qwen3-fc-6m", "num_cpus": 0.5, "kv_cache_bytes": 64 << 20,
                         "budget_controller": True, "memory_reader": "cpu", "control_period_s": 0.2}),
              name="structkv", route_prefix="/")
    yield "http://127.0.0.1:8123"
    serve.shutdown()
    from cluster.control import CONTROLLER_NAME, NAMESPACE
    ray_cluster.kill(ray_cluster.get_actor(CONTROLLER_NAME, namespace=NAMESPACE))


def test_replica_reports_to_the_budget_controller(serve_url, ray_cluster):
    import time

    from cluster.control import CONTROLLER_NAME, NAMESPACE
    controller = ray_cluster.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    for _ in range(100):
        status = ray_cluster.get(controller.status.remote())
        if status["replicas"]:
            break
        time.sleep(0.2)
    (replica,) = status["replicas"].values()
    assert replica["budget"] == 1.0 and replica["reading"]["source"] == "cpu"
    assert replica["reading"]["total_bytes"] == 64 << 20


def test_chat_tool_call_over_http(serve_url):
    r = httpx.post(f"{serve_url}/v1/chat/completions", timeout=120, json={
        "model": "qwen3-fc-6m", "messages": [{"role": "user", "content": "Weather in Rome?"}],
        "tools": [TOOL], "tool_choice": "required", "max_tokens": 40})
    assert r.status_code == 200, r.text
    call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    jsonschema.validate(json.loads(call["arguments"]), TOOL["function"]["parameters"])
    assert httpx.get(f"{serve_url}/v1/models").json()["data"][0]["id"] == "qwen3-fc-6m"
    bad = httpx.post(f"{serve_url}/v1/chat/completions", json={"model": "other", "messages": []})
    assert bad.status_code == 400 and "error" in bad.json()


def test_bad_app_args_are_refused():
    from pydantic import ValidationError

    from cluster.app import build_app
    with pytest.raises(ValidationError, match="kv_budget"):
        build_app({"kv_budget": 2})
    with pytest.raises(ValueError, match="unknown kv_policy"):
        build_app({"kv_policy": "nope"})
