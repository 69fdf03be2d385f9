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
                         "num_replicas": 2, "budget_controller": True, "memory_reader": "cpu",
                         "control_period_s": 0.2}),
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
        if len(status["replicas"]) == 2:
            break
        time.sleep(0.2)
    assert len(status["replicas"]) == 2
    for replica in status["replicas"].values():
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


def _replica_stats(n: int = 2, timeout_s: float = 60) -> dict[str, dict]:
    """``LLMServer.stats`` of every replica (handle calls land on replicas at random; a new replica
    reaches the handle a little after it is up)."""
    import time

    from ray import serve
    handle = serve.get_deployment_handle("LLMServer", "structkv")
    seen: dict[str, dict] = {}
    deadline = time.time() + timeout_s
    while len(seen) < n and time.time() < deadline:
        s = handle.stats.remote().result(timeout_s=60)
        seen[s["replica"]] = s
        if len(seen) < n:
            time.sleep(0.05)
    return seen


def _wait_idle(timeout_s: float = 60) -> dict[str, dict]:
    import time
    deadline = time.time() + timeout_s
    while True:
        stats = _replica_stats()
        if all(s["kv_bytes_used"] == 0 and s["num_running"] == 0 and s["num_waiting"] == 0 for s in stats.values()) \
                or time.time() > deadline:
            return stats
        time.sleep(0.5)


def test_health_goes_through_the_engine_and_disconnects_free_kv(serve_url):
    assert httpx.get(f"{serve_url}/health", timeout=60).json() == {"status": "ok"}
    body = {"model": "qwen3-fc-6m", "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client:
        for _ in range(3):  # open streams, read a little, hang up
            with client.stream("POST", f"{serve_url}/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                next(r.iter_lines())
    stats = _wait_idle()
    assert len(stats) == 2
    assert all(s["kv_bytes_used"] == 0 and s["num_running"] == 0 for s in stats.values()), stats


def test_a_replica_killed_under_load(serve_url, ray_cluster):
    """Kill one of the two engine replicas (SIGKILL) with streams and plain requests in flight: each
    request ends complete, or with 503 + Retry-After in the OpenAI envelope, or (a stream already
    under way) with a final SSE error event; after the replacement is up, zero errors and no KV held."""
    import os
    import signal
    import threading
    import time

    from ray import serve

    def replica_pids():
        return {r: s["pid"] for r, s in _replica_stats().items()}

    def running():
        return serve.status().applications["structkv"].deployments["LLMServer"].replica_states.get("RUNNING", 0)

    before = _replica_stats()
    assert len(before) == 2
    outcomes: list[str] = []
    stop = threading.Event()

    def client(i: int):
        streaming = i % 2 == 0
        body = {"model": "qwen3-fc-6m", "messages": [{"role": "user", "content": f"Story {i}."}],
                "max_tokens": 300, "ignore_eos": True, "stream": streaming}
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                try:
                    if streaming:
                        with c.stream("POST", f"{serve_url}/v1/chat/completions", json=body) as r:
                            if r.status_code != 200:
                                r.read()
                                outcomes.append(_classify(r))
                                continue
                            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
                        if lines and lines[-1] == "data: [DONE]":
                            outcomes.append("ok")
                        elif lines and json.loads(lines[-1][6:]).get("error", {}).get("code") == 503:
                            outcomes.append("stream error event")
                        else:
                            outcomes.append(f"stream cut: {lines[-1:]}")
                    else:
                        outcomes.append(_classify(c.post(f"{serve_url}/v1/chat/completions", json=body)))
                except httpx.HTTPError as e:
                    outcomes.append(f"transport: {type(e).__name__}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    time.sleep(3)
    busiest = max(_replica_stats().values(), key=lambda s: s["num_running"])
    assert busiest["num_running"] >= 1  # the replica dies with requests in flight
    victim = busiest["pid"]
    os.kill(victim, signal.SIGKILL)
    time.sleep(6)
    stop.set()
    for t in threads:
        t.join(timeout=180)
    bad = [o for o in outcomes if o not in ("ok", "503 retry-after", "stream error event")]
    assert not bad, bad

    deadline = time.time() + 180
    while running() < 2 and time.time() < deadline:  # Serve notices and starts a replacement
        time.sleep(1)
    after = replica_pids()
    assert len(after) == 2 and victim not in after.values()
    for _ in range(120):
        if httpx.get(f"{serve_url}/health", timeout=60).status_code == 200 and len(_replica_stats()) == 2:
            break
        time.sleep(1)
    results = [_classify(httpx.post(f"{serve_url}/v1/chat/completions", timeout=120, json={
        "model": "qwen3-fc-6m", "messages": [{"role": "user", "content": "Weather in Rome?"}], "tools": [TOOL],
        "tool_choice": "required", "max_tokens": 40})) for _ in range(6)]
    assert results == ["ok"] * 6, results
    stats = _wait_idle()
    assert all(s["kv_bytes_used"] == 0 for s in stats.values()), stats


def _classify(r: httpx.Response) -> str:
    if r.status_code == 200:
        return "ok" if r.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls") else "bad body"
    if r.status_code == 503 and r.headers.get("retry-after") and r.json().get("error", {}).get("code") == 503:
        return "503 retry-after"
    return f"{r.status_code}: {r.text[:200]}"
