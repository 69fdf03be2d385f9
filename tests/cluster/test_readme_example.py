"""The README's example request, sent as written there, through the HTTP app (FastAPI over the async
engine, no Ray): the embedded model answers it with the right call."""

import asyncio
import json
import re
from pathlib import Path

import httpx
import pytest

from cluster.openai_api import OpenAIServer, build_app
from replicas.async_engine import AsyncLLMEngine

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_request() -> dict:
    """The JSON body of the curl command in the README's "Example request" section."""
    section = README.read_text().split("## Example request", 1)[1].split("\n## ", 1)[0]
    body = re.search(r"curl -s http://127\.0\.0\.1:8000/v1/chat/completions .*? -d '(.*?)'\n```", section, re.S)
    assert body, "no curl command with a -d body in the README's Example request section"
    return json.loads(body.group(1))


@pytest.fixture(scope="module")
def app(engine):
    server = OpenAIServer(AsyncLLMEngine(engine), "qwen3-fc-6m", max_pending=8)
    yield build_app(server)
    server.engine.shutdown()


def test_readme_example_request_is_answered_right(app):
    body = readme_request()
    assert body["model"] == "qwen3-fc-6m" and body["tools"][0]["function"]["name"] == "get_weather"

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return await c.post("/v1/chat/completions", json=body)
    r = asyncio.run(go())
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    calls = choice["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}


def test_readme_streamed_json_schema_example_follows_the_schema(app):
    """The README's second example (``curl -sN``: ``response_format`` json_schema, streamed) as
    written: the deltas join into JSON that validates against the schema."""
    import jsonschema
    section = README.read_text().split("## Example request", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"curl -sN http://127\.0\.0\.1:8000/v1/chat/completions .*? -d '(.*?)'\n```", section, re.S)
    assert found, "no streamed curl example in the README's Example request section"
    body = json.loads(found.group(1))
    assert body["stream"] is True

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return await c.post("/v1/chat/completions", json=body)
    r = asyncio.run(go())
    assert r.status_code == 200, r.text
    chunks = [json.loads(line[len("data: "):]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    jsonschema.validate(json.loads(text), body["response_format"]["json_schema"]["schema"])
