"""Every edge limit and refusal of the API, tried once: the input and the response seen.

    python -m bench.edge_limits [--out docs/results/edge_limits.md]

Runs the FastAPI app in-process (the same app Ray Serve mounts) on the embedded model with the
default ``Limits`` and an API key, sends each case, and writes a Markdown table: case, input,
HTTP status, error type and message. Afterwards it checks the app still answers a normal request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

KEY = "edge-key"
MODEL = "qwen3-fc-6m"


def _chat(**kw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 8}
    body.update(kw)
    return body


def _deep(n):
    s = {"type": "string"}
    for _ in range(n):
        s = {"type": "object", "properties": {"a": s}}
    return s


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

CASES = [
    ("no API key", "POST /v1/chat/completions without Authorization", _chat(), {"auth": False}),
    ("wrong API key", "Authorization: Bearer wrong", _chat(), {"auth": "wrong"}),
    ("/health without key", "GET /health", None, {"auth": False, "method": "GET", "path": "/health"}),
    ("header size", "a 100 KB header", _chat(max_tokens=2), {"headers": {"X-Pad": "a" * 100_000}}),
    ("body size", "3 MiB of message text", _chat(messages=[{"role": "user", "content": "x" * (3 << 20)}]), {}),
    ("malformed JSON", "body '{\"model\": '", "{\"model\": ", {"raw": True}),
    ("unknown model", "model 'gpt-9'", _chat(model="gpt-9"), {}),
    ("n > 1", "n = 2", _chat(n=2), {}),
    ("stop strings", "17 stop strings", _chat(stop=[f"s{i}" for i in range(17)]), {}),
    ("stop length", "a 257-character stop string", _chat(stop=["x" * 257]), {}),
    ("tools", "129 tools", _chat(tools=[TOOL] * 129), {}),
    ("tool name", "a 65-character tool name", _chat(tools=[{"type": "function", "function": {"name": "f" * 65}}]), {}),
    ("schema depth", "tool parameters nested 40 deep", _chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": _deep(40)}}]), {}),
    ("schema size", "a 300 KiB response_format schema", _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "description": "d" * (300 << 10)}}}), {}),
    ("uncompilable schema", "$ref to a missing definition", _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/missing"}}}}}), {}),
    ("unenforceable schema", "uniqueItems: true", _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}), {}),
    ("unknown tool_choice", "tool_choice names a missing tool", _chat(tools=[TOOL], tool_choice={
        "type": "function", "function": {"name": "nope"}}), {}),
    ("context", "20,000 words of prompt", _chat(messages=[{"role": "user", "content": "word " * 20000}]), {}),
    ("max_tokens", "max_tokens 5000 (context 4096)", _chat(max_tokens=5000), {}),
    ("max_tokens", "max_tokens 0", _chat(max_tokens=0), {}),
    ("seed", "seed 2**64", _chat(seed=2**64), {}),
    ("kv_budget", "kv_budget 1.5", _chat(kv_budget=1.5), {}),
    ("unknown fields", "an unknown top-level field 'foo' (ignored, as OpenAI)", _chat(foo=1), {}),
    ("unknown route", "GET /v1/nope", None, {"method": "GET", "path": "/v1/nope"}),
    ("wrong method", "GET /v1/chat/completions", None, {"method": "GET"}),
]


def run(out: Path | None) -> int:
    import httpx

    from cluster.openai_api import OpenAIServer, build_app
    from replicas.async_engine import AsyncLLMEngine
    from replicas.config import EngineConfig
    from replicas.engine import LLMEngine
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(kv_cache_bytes=64 << 20)))
    app = build_app(OpenAIServer(engine, MODEL, api_key=KEY))

    async def send(body, opts):
        headers = {} if opts.get("auth") is False else {"Authorization": f"Bearer {opts.get('auth') or KEY}"}
        headers.update(opts.get("headers", {}))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120) as c:
            method, path = opts.get("method", "POST"), opts.get("path", "/v1/chat/completions")
            if opts.get("raw"):
                return await c.request(method, path, content=body, headers={**headers, "Content-Type": "application/json"})
            return await c.request(method, path, json=body, headers=headers)

    rows = ["| limit / fault | input | status | error type | message |", "|---|---|---:|---|---|"]
    for name, what, body, opts in CASES:
        r = asyncio.run(send(body, opts))
        try:
            err = r.json().get("error") or {}
        except json.JSONDecodeError:
            err = {"message": r.text[:100]}
        msg = " ".join((err.get("message") or "(response ok)").split()).replace("|", "\\|")[:140]
        rows.append(f"| {name} | {what} | {r.status_code} | {err.get('type', '-')} | {msg} |")
    after = asyncio.run(send(_chat(), {}))
    rows.append("")
    rows.append(f"After all cases, a normal request: HTTP {after.status_code}.")
    engine.shutdown()
    text = "\n".join(rows)
    print(text)
    if out:
        out.write_text("# Limits at the edge, tried\n\n`python -m bench.edge_limits` (in-process app, default limits, "
                       "an API key set).\n\n" + text + "\n")
    return 0 if after.status_code == 200 else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.edge_limits", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    return run(ap.parse_args(argv).out)


if __name__ == "__main__":
    sys.exit(main())
