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


def test_bfcl_questions_through_the_openai_sdk(serve_url):
    """A short version of `python -m bench.serve_sdk bfcl`: real BFCL questions and functions."""
    openai = pytest.importorskip("openai")
    from models import bfcl
    client = openai.OpenAI(base_url=f"{serve_url}/v1", api_key="none", max_retries=0, timeout=120)
    for q in [q for q in bfcl.load_questions("simple_python") if q.ground_truth][:3]:
        tools = [bfcl.to_openai_tool(f, q.language) for f in q.functions]
        r = client.chat.completions.create(model="qwen3-fc-6m", messages=q.messages, tools=tools,
                                           tool_choice="required", max_tokens=96, temperature=0)
        (call,) = r.choices[0].message.tool_calls[:1]
        jsonschema.validate(json.loads(call.function.arguments), tools[0]["function"]["parameters"])


def test_metrics_read_back_from_the_export_endpoint(serve_url, ray_cluster):
    import time
    import urllib.request
    port = ray_cluster.nodes()[0].get("MetricsExportPort")
    if not port:
        pytest.skip("this Ray node exports no metrics")
    bad = {"model": "qwen3-fc-6m", "messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
            "a": {"$ref": "#/missing"}}}}}}
    assert httpx.post(f"{serve_url}/v1/chat/completions", json=bad, timeout=60).status_code == 400
    names = ("ray_structkv_replica_kv_budget", "ray_structkv_replica_memory_fraction", "ray_structkv_controller_budget",
             "ray_structkv_requests", "ray_structkv_generation_tokens", "ray_structkv_ttft_seconds",
             "ray_structkv_inter_token_latency_seconds", "ray_structkv_request_kv_ratio",
             "ray_structkv_grammar_compile_failures")
    seen = set()
    for _ in range(60):
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        except OSError:
            text = ""
        seen = {name for name in names if name in text}
        if len(seen) == len(names):
            break
        time.sleep(1)
    assert seen == set(names), f"missing on the metrics endpoint: {set(names) - seen}"
