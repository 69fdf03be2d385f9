"""The OpenAI-compatible API in-process (FastAPI over the async engine, no Ray): responses,
streaming, tool calls that validate, the unchanged openai SDK, and the error envelope."""

import asyncio
import json

import httpx
import jsonschema
import pytest

from cluster.openai_api import OpenAIServer, build_app
from replicas.async_engine import AsyncLLMEngine

# Bounded outputs (enums, booleans): valid whatever the small model prefers.
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather of a city.",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "high"]}},
          "required": ["ok", "level"], "additionalProperties": False}
MODEL = "qwen3-fc-6m"


@pytest.fixture(scope="module")
def app(engine):
    server = OpenAIServer(AsyncLLMEngine(engine), MODEL, max_pending=64)
    yield build_app(server)
    server.engine.shutdown()


def call(app, method, path, body=None):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return await c.request(method, path, json=body)
    return asyncio.run(go())


def chat(**kw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "max_tokens": 64}
    body.update(kw)
    return body


def test_models_and_health(app):
    assert call(app, "GET", "/health").status_code == 200
    assert call(app, "GET", "/v1/models").json()["data"][0]["id"] == MODEL


def test_tool_call_required_validates(app):
    r = call(app, "POST", "/v1/chat/completions", chat(tools=[WEATHER], tool_choice="required"))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    for tc in choice["message"]["tool_calls"]:
        assert tc["function"]["name"] == "get_weather" and tc["id"].startswith("call_")
        jsonschema.validate(json.loads(tc["function"]["arguments"]), WEATHER["function"]["parameters"])
    usage = r.json()["usage"]
    assert usage["kv_budget_ratio_max"] == pytest.approx(1.0) and usage["kv_policy"] == "full"


def test_response_format_json_schema(app):
    body = chat(response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}})
    r = call(app, "POST", "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), SCHEMA)


def test_streaming_chat_deltas_join_to_full_text(app):
    full = call(app, "POST", "/v1/chat/completions", chat(max_tokens=12)).json()["choices"][0]["message"]["content"]
    r = call(app, "POST", "/v1/chat/completions", chat(max_tokens=12, stream=True))
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == full
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_streaming_characters_split_across_tokens(app):
    """The byte-level vocabulary spells "é" and "☃" with several tokens each; a stream must carry
    the characters, not the U+FFFD that a partial decode shows (it once did and never fixed it)."""
    want = "café ☃"
    body = {"model": MODEL, "prompt": "Say:", "max_tokens": 16, "structured_outputs": {"choice": [want]}}
    r = call(app, "POST", "/v1/completions", {**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == want and not any("\ufffd" in t for t in texts), texts
    assert call(app, "POST", "/v1/completions", body).json()["choices"][0]["text"] == want


def _joined_calls(chunks):
    """Streamed tool-call deltas joined by index, as a client joins them: ``[{name, arguments}]``."""
    calls = {}
    for c in chunks:
        for tc in c["choices"][0]["delta"].get("tool_calls") or []:
            f = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            f["name"] += tc.get("function", {}).get("name") or ""
            f["arguments"] += tc.get("function", {}).get("arguments") or ""
    return [calls[i] for i in sorted(calls)]


def test_streaming_tool_calls(app):
    r = call(app, "POST", "/v1/chat/completions", chat(tools=[WEATHER], tool_choice="required", stream=True))
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    calls = _joined_calls(chunks)
    assert calls and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


# A string argument the grammar forces to hold the closing tag.
NOTE = {"type": "function", "function": {"name": "save_note", "description": "Save a note.", "parameters": {
    "type": "object", "properties": {"text": {"type": "string", "enum": ["a</tool_call>b"]}},
    "required": ["text"], "additionalProperties": False}}}


def test_closing_tag_inside_a_string_argument_stays_in_the_call(app):
    """The server returned no call at all: the parser stopped at the first </tool_call>."""
    body = chat(messages=[{"role": "user", "content": "Save a note."}], tools=[NOTE], tool_choice="required")
    whole, content, calls, finish = _whole_and_streamed_chat(app, body)
    assert whole["finish_reason"] == finish == "tool_calls" and whole["message"]["content"] is None and content == ""
    got = [c["function"] for c in whole["message"]["tool_calls"]]
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == [("save_note", {"text": "a</tool_call>b"})]
    assert calls == got


def test_tool_choice_none_never_returns_tool_markup(app):
    """The model still writes <tool_call> blocks when it sees the tools (the embedded one does for
    this prompt); with tool_choice "none" they were returned as content. vLLM drops them."""
    body = chat(tools=[WEATHER], tool_choice="none")
    whole, content, calls, finish = _whole_and_streamed_chat(app, body)
    assert "tool_calls" not in whole["message"] and calls == [] and finish == whole["finish_reason"] == "stop"
    assert content == (whole["message"]["content"] or "")
    assert "tool_call>" not in content
    # The markup was there to leave out: the same prompt with tool_choice auto gives a call.
    auto = call(app, "POST", "/v1/chat/completions", chat(tools=[WEATHER], tool_choice="auto")).json()
    assert auto["choices"][0]["message"]["tool_calls"]


def _sdk_chat(app, **kw):
    """The whole answer and the stream through the openai SDK, with the SDK's own accumulation of
    the stream (``ChatCompletionStreamState``) and each streamed chunk."""
    openai = pytest.importorskip("openai")
    from openai.lib.streaming.chat import ChatCompletionStreamState

    async def go():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test/v1")
        client = openai.AsyncOpenAI(api_key="unused", base_url="http://test/v1", http_client=http)
        whole = await client.chat.completions.create(model=MODEL, **kw)
        state, chunks = ChatCompletionStreamState(), []
        async for chunk in await client.chat.completions.create(model=MODEL, stream=True, **kw):
            state.handle_chunk(chunk)
            chunks.append(chunk)
        await http.aclose()
        return whole, state.get_final_completion(), chunks
    return asyncio.run(go())


@pytest.mark.parametrize("query,n_calls", [
    ("Weather in Oslo, celsius?", 1),
    ("Get weather for each of these: city Paris and unit celsius; city Oslo and unit celsius; "
     "city Rome and unit fahrenheit.", 3)])
def test_sdk_streams_tool_calls_as_openai_does(app, query, n_calls):
    """A call's first delta carries index, id, type and name (arguments ""); then argument
    fragments arrive as they are written, before the call ends (they came in one delta at the
    end); the SDK's accumulation is the whole answer, for one call and for parallel calls."""
    whole, joined, chunks = _sdk_chat(app, messages=[{"role": "user", "content": query}], tools=[WEATHER],
                                      tool_choice="required", max_tokens=120)
    want = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert len(want) == n_calls and whole.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in joined.choices[0].message.tool_calls] == want
    assert joined.choices[0].finish_reason == "tool_calls" and not joined.choices[0].message.content
    assert all(c.id.startswith("call_") and c.type == "function" for c in joined.choices[0].message.tool_calls)
    deltas = [(k, tc) for k, chunk in enumerate(chunks) if chunk.choices
              for tc in chunk.choices[0].delta.tool_calls or []]
    last = len(chunks) - 1
    assert chunks[last].choices[0].finish_reason == "tool_calls" and not chunks[last].choices[0].delta.tool_calls
    for i in range(n_calls):
        mine = [(k, tc) for k, tc in deltas if tc.index == i]
        (k0, head), rest = mine[0], mine[1:]
        assert head.id and head.type == "function" and head.function.name == want[i][0] and head.function.arguments == ""
        assert all(tc.id is None and tc.function.name is None for _, tc in rest)
        assert len(rest) > 1 and rest[0][0] < rest[-1][0] < last   # several fragments, spread over chunks
        assert "".join(tc.function.arguments for _, tc in rest) == want[i][1]
        if i + 1 < n_calls:   # a call's arguments stream before the next call starts
            assert rest[-1][0] < next(k for k, tc in deltas if tc.index == i + 1)


def test_completions_with_structured_outputs(app):
    r = call(app, "POST", "/v1/completions", {"model": MODEL, "prompt": "Answer:", "max_tokens": 8,
                                              "structured_outputs": {"choice": ["yes", "no"]}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in ("yes", "no")
    for grammar in ('root ::= "on" | "off"', 'start: "on" | "off"'):  # EBNF, then Lark
        r = call(app, "POST", "/v1/completions", {"model": MODEL, "prompt": "Switch:", "max_tokens": 8,
                                                  "structured_outputs": {"grammar": grammar}})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("on", "off"), r.text
    r = call(app, "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "structured_outputs": {
        "grammar": "start: missing_rule"}})
    assert r.status_code == 400 and "lark" in r.json()["error"]["message"]


@pytest.mark.parametrize("path,body,status,needle", [
    ("/v1/chat/completions", chat(model="gpt-9"), 404, "does not exist"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", chat(n=2), 400, "n"),
    ("/v1/chat/completions", chat(max_tokens=0), 400, "max_tokens"),
    ("/v1/chat/completions", chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
     400, "not among the tools"),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/missing"}}}}}), 400, "json_schema"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "hi " * 5000}]), 400, "context"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 99999999], "max_tokens": 2}, 400, "outside"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "structured_outputs": {"regex": "(", "choice": ["a"]}},
     400, "one of"),
])
def test_errors_use_openai_envelope(app, path, body, status, needle):
    r = call(app, "POST", path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] or needle == err.get("param")
    assert err["code"] == status and err["type"]


def test_openai_sdk_unchanged(app):
    openai = pytest.importorskip("openai")

    async def go():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test/v1")
        client = openai.AsyncOpenAI(api_key="unused", base_url="http://test/v1", http_client=http)
        resp = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo, celsius?"}],
            tools=[WEATHER], tool_choice="required", max_tokens=64)
        await http.aclose()
        return resp
    resp = asyncio.run(go())
    tc = resp.choices[0].message.tool_calls[0]
    assert resp.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(tc.function.arguments), WEATHER["function"]["parameters"])


def test_api_key_required_on_v1_routes(engine):
    server = OpenAIServer(AsyncLLMEngine(engine), MODEL, api_key="s3cret")
    app = build_app(server)

    async def go(headers, path="/v1/models"):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return await c.get(path, headers=headers)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        r = asyncio.run(go(headers))
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", headers
        assert r.headers["www-authenticate"] == "Bearer"
    assert asyncio.run(go({"Authorization": "Bearer s3cret"})).json()["data"][0]["id"] == MODEL
    assert asyncio.run(go({}, "/health")).status_code == 200
    server.engine.shutdown()


def _deep(n):
    s = {"type": "string"}
    for _ in range(n):
        s = {"type": "object", "properties": {"a": s}}
    return s


@pytest.mark.parametrize("body,status,needle", [
    (chat(stop=[f"s{i}" for i in range(17)]), 400, "stop"),
    (chat(stop=["x" * 257]), 400, "stop"),
    (chat(tools=[WEATHER] * 129), 400, "129 tools"),
    (chat(tools=[{"type": "function", "function": {"name": "f" * 65, "parameters": {}}}]), 400, "65 characters"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": _deep(40)}}]), 400, "deeper than 32"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "description": "d" * (300 << 10)}}}), 400, "over the limit"),
    (chat(max_tokens=5000), 400, "exceeds the context"),
])
def test_limits_at_the_edge(app, body, status, needle):
    r = call(app, "POST", "/v1/chat/completions", body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


def test_body_over_the_limit_is_413(engine):
    from cluster.protocol import Limits
    server = OpenAIServer(AsyncLLMEngine(engine), MODEL, limits=Limits(max_body_bytes=1000))
    small = build_app(server)
    r = call(small, "POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": "x" * 2000}]))
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    assert call(small, "POST", "/v1/chat/completions", chat(max_tokens=2)).status_code == 200
    server.engine.shutdown()


def test_headers_over_the_limit_are_431(app):
    async def go(pad):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return await c.get("/v1/models", headers={"X-Pad": "a" * pad})
    r = asyncio.run(go(40_000))
    assert r.status_code == 431 and "over the limit of 32768" in r.json()["error"]["message"]
    assert asyncio.run(go(1_000)).status_code == 200


def test_new_user_findings(app):
    """Found by a new-user trial: each was a 500, a leak of raw markup, or a refused short prompt."""
    r = call(app, "POST", "/v1/chat/completions", chat(seed=2**64, max_tokens=2))
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
    # A tool call cut by max_tokens is dropped, not returned as "<tool_call>..." content.
    r = call(app, "POST", "/v1/chat/completions", chat(tools=[WEATHER], tool_choice="required", max_tokens=5))
    msg = r.json()["choices"][0]
    assert r.status_code == 200 and msg["finish_reason"] == "length"
    assert "<tool_call>" not in (msg["message"]["content"] or "") and not msg["message"].get("tool_calls")
    # A prompt too short for the budget is served at one page per layer; usage says what it got.
    r = call(app, "POST", "/v1/completions", {"model": MODEL, "prompt": "Pick:", "max_tokens": 4, "kv_budget": 0.5})
    assert r.status_code == 200 and r.json()["usage"]["kv_budget_ratio_max"] <= 1.0
    # An unenforceable tool schema is a 400 on "tools".
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}}}
    r = call(app, "POST", "/v1/chat/completions", chat(tools=[bad], tool_choice="required"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert "cannot enforce" in r.json()["error"]["message"]


def test_unknown_route_and_method_use_the_envelope(app):
    r = call(app, "GET", "/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = call(app, "GET", "/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == 405



def test_malformed_json_and_form_bodies_say_what_is_wrong(app):
    """Found by a new-user trial: a cut-off JSON body answered "invalid request body at 38" with
    param "38", and ``curl -d`` without the JSON header gave no hint about it."""
    async def post(text, content_type):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return await c.post("/v1/chat/completions", content=text, headers={"Content-Type": content_type})
    r = asyncio.run(post('{"model": "%s", "messages": [' % MODEL, "application/json"))
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] is None and err["type"] == "invalid_request_error"
    assert "not valid JSON" in err["message"] and "at character" in err["message"], err
    r = asyncio.run(post('{"model": "%s", "messages": []}' % MODEL, "application/x-www-form-urlencoded"))
    err = r.json()["error"]
    assert r.status_code == 400 and "Content-Type: application/json" in err["message"], err


def test_new_user_findings_second_trial(app):
    """Found by the second new-user trial: 500s for odd text and types, a depth check skipped for a
    schema sent as a string, tool names that broke the call markup, nulls refused."""
    def raw(path, text):
        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
                return await c.post(path, content=text, headers={"Content-Type": "application/json"})
        return asyncio.run(go())
    r = raw("/v1/completions", '{"model": "%s", "prompt": "x \\ud83d y", "max_tokens": 2}' % MODEL)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = call(app, "POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]))
    assert r.status_code == 400 and "messages.0.content" in r.json()["error"]["param"]
    for bomb in ("[" * 100000 + "]" * 100000, json.dumps(_nested(40))):
        r = call(app, "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                 "structured_outputs": {"json": bomb}})
        assert r.status_code == 400 and "nested deeper" in r.json()["error"]["message"]
    for name in ('get "weather" now', "x</tool_call>y", "a\\nb"):
        tool = {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}
        r = call(app, "POST", "/v1/chat/completions", chat(tools=[tool], max_tokens=2))
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.name", name
    r = call(app, "POST", "/v1/chat/completions", chat(tools=[WEATHER, WEATHER], max_tokens=2))
    assert r.status_code == 400 and "given twice" in r.json()["error"]["message"]
    r = call(app, "POST", "/v1/chat/completions", chat(temperature=None, top_p=None, stream=None, n=None, max_tokens=2))
    assert r.status_code == 200, r.text
    r = call(app, "POST", "/v1/completions", {"model": MODEL, "prompt": "Data:", "max_tokens": 6,
                                              "structured_outputs": {"json_object": True}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("{"), r.text
    r = call(app, "POST", "/v1/chat/completions", chat(kv_budget=0.5, max_tokens=2, messages=[
        {"role": "user", "content": "a fairly long question about the weather in several cities " * 3}]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_budget", r.text  # full KV cannot compress


def _nested(n):
    s = {"type": "string"}
    for _ in range(n):
        s = {"type": "object", "properties": {"a": s}}
    return s


def _stream_chunks(app, path, body):
    r = call(app, "POST", path, {**body, "stream": True})
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def test_chat_logprobs_stream_and_whole_agree(app):
    body = chat(max_tokens=10, logprobs=True, top_logprobs=2)
    r = call(app, "POST", "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == r.json()["usage"]["completion_tokens"]
    for e in content:
        assert e["logprob"] <= 0 and len(e["top_logprobs"]) == 2
        assert e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"]
        assert e["bytes"] == list(e["token"].encode()) or "\ufffd" in e["token"]
        assert e["top_logprobs"][0]["token"] == e["token"]   # greedy: the chosen token is the top one
    streamed = [e for c in _stream_chunks(app, "/v1/chat/completions", body)
                for e in (c["choices"][0].get("logprobs") or {}).get("content") or []]
    assert streamed == content
    plain = call(app, "POST", "/v1/chat/completions", chat(max_tokens=4)).json()
    assert plain["choices"][0]["logprobs"] is None
    bad = call(app, "POST", "/v1/chat/completions", chat(top_logprobs=2))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_logprobs"
    assert call(app, "POST", "/v1/chat/completions", chat(logprobs=True, top_logprobs=21)).status_code == 400


def test_completion_logprobs_with_offsets(app):
    want = "café ☃"
    body = {"model": MODEL, "prompt": "Say:", "max_tokens": 16, "logprobs": 3,
            "structured_outputs": {"choice": [want]}}
    r = call(app, "POST", "/v1/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == want and len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert all(len(t) <= 4 for t in lp["top_logprobs"])   # 3 and the sampled token
    assert all(top[tok] == v for tok, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))
    # Offsets point at each token's text: the ASCII tokens of "caf" sit where they decode; the
    # end-of-turn token closing the choice is listed with its name and adds no text.
    assert lp["tokens"][-1] == "<|im_end|>" and lp["text_offset"][-1] == len(want)
    for tok, at in zip(lp["tokens"][:-1], lp["text_offset"]):
        if tok.isascii():
            assert want[at:at + len(tok)] == tok
    chunks = _stream_chunks(app, "/v1/completions", body)
    joined = {k: [x for c in chunks for x in (c["choices"][0].get("logprobs") or {}).get(k, [])] for k in lp}
    assert joined == lp
    assert call(app, "POST", "/v1/completions", {**body, "logprobs": -1}).status_code == 400


def test_penalties_and_truncation_sampling_fields(app):
    """vLLM's sampling fields are taken (they were silently ignored) and checked."""
    base = chat(max_tokens=12, ignore_eos=True)
    plain = call(app, "POST", "/v1/chat/completions", base).json()["choices"][0]["message"]["content"]
    r = call(app, "POST", "/v1/chat/completions", {**base, "frequency_penalty": 2.0, "repetition_penalty": 3.0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] != plain
    sampled = {**base, "temperature": 1.0, "top_k": 1, "min_p": 0.5, "seed": 3}
    assert call(app, "POST", "/v1/chat/completions", sampled).json()["choices"][0]["message"]["content"] == plain
    for field, value in (("top_k", -2), ("min_p", 2), ("presence_penalty", 3), ("repetition_penalty", 0)):
        bad = call(app, "POST", "/v1/chat/completions", {**base, field: value})
        assert bad.status_code == 400 and field in bad.text, (field, bad.text)


def test_logit_bias(app, engine):
    body = {"model": MODEL, "prompt": "Say:", "max_tokens": 3, "ignore_eos": True, "logit_bias": {"88": 100}}
    x = call(app, "POST", "/v1/completions", {**body, "logprobs": 0}).json()
    assert x["choices"][0]["logprobs"]["tokens"] == [engine.tokenizer.decode([88])] * 3
    for bias, needle in (({"x": 1}, "token ids"), ({"999999": 1}, "outside"), ({"5": 500}, "logit_bias"),
                         ({"+5": 1}, "decimal"), ({"1_0": 1}, "decimal"), ({"\u0663": 1}, "decimal"),
                         ({"5": 1, "05": 2}, "distinct")):
        bad = call(app, "POST", "/v1/completions", {"model": MODEL, "prompt": "Say:", "logit_bias": bias})
        assert bad.status_code == 400 and needle in bad.text and bad.json()["error"]["param"] == "logit_bias", bad.text


def test_streamed_text_never_runs_past_a_stop_string(app):
    """Found by a new-user trial: the stream sent the start of a stop string before the rest of it
    arrived (" P V" streamed, " P" returned whole for stop " V V")."""
    want = "café ☃ 東京 end"
    for stop in (["☃ "], ["東京 e"], [" e", "x"], ["zzz"]):
        body = {"model": MODEL, "prompt": "Say:", "max_tokens": 24, "stop": stop,
                "structured_outputs": {"choice": [want]}}
        whole = call(app, "POST", "/v1/completions", body).json()["choices"][0]["text"]
        assert whole == want.split(stop[0])[0]
        chunks = _stream_chunks(app, "/v1/completions", body)
        assert "".join(c["choices"][0]["text"] for c in chunks) == whole, stop


def test_chat_logprob_bytes_rebuild_split_characters(app):
    """OpenAI's ``bytes`` let a client join a character split across tokens; each piece shows as
    U+FFFD in ``token`` (found by a new-user trial: bytes were U+FFFD's own)."""
    schema = {"type": "object", "properties": {"a": {"enum": ["café ☃ 東京"]}}, "required": ["a"],
              "additionalProperties": False}
    body = chat(max_tokens=40, logprobs=True, response_format={"type": "json_schema", "json_schema": {
        "name": "r", "schema": schema, "strict": True}})
    r = call(app, "POST", "/v1/chat/completions", body).json()
    content = r["choices"][0]["message"]["content"]
    entries = r["choices"][0]["logprobs"]["content"]
    assert any("\ufffd" in e["token"] for e in entries)
    assert bytes(b for e in entries for b in e["bytes"]).decode().endswith("<|im_end|>")
    assert bytes(b for e in entries for b in e["bytes"]).decode().startswith(content)


def test_stop_token_ids_include_stop_str_and_unsupported_fields(app, engine):
    """Found by a new-user trial: these vLLM / OpenAI fields were silently ignored."""
    want = "café ☃ 東京 end"
    body = {"model": MODEL, "prompt": "Say:", "max_tokens": 24, "structured_outputs": {"choice": [want]}}
    r = call(app, "POST", "/v1/completions", {**body, "stop": ["東京"], "include_stop_str_in_output": True})
    assert r.json()["choices"][0]["text"] == "café ☃ 東京"
    stop_id = engine.tokenizer("c", add_special_tokens=False)["input_ids"][0]
    r = call(app, "POST", "/v1/completions", {**body, "stop_token_ids": [stop_id]})
    assert r.json()["choices"][0]["text"] == "" and r.json()["choices"][0]["finish_reason"] == "stop"
    r = call(app, "POST", "/v1/completions", {**body, "stop_token_ids": [stop_id], "include_stop_str_in_output": True})
    assert r.json()["choices"][0]["text"] == "c" and r.json()["choices"][0]["finish_reason"] == "stop"
    bad = call(app, "POST", "/v1/completions", {**body, "stop_token_ids": [99999]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stop_token_ids"
    for field, value in (("echo", True), ("best_of", 2), ("suffix", "x"), ("min_tokens", 3), ("prompt_logprobs", 1),
                         ("guided_choice", ["a"]), ("allowed_token_ids", [1]), ("bad_words", ["x"])):
        bad = call(app, "POST", "/v1/completions", {**body, field: value})
        assert bad.status_code == 400 and f"{field} is not supported" in bad.text, (field, bad.text)
    for field, value in (("echo", False), ("best_of", 1), ("min_tokens", 0), ("guided_choice", None)):
        assert call(app, "POST", "/v1/completions", {**body, field: value}).status_code == 200, field


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": False}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": "2"}),
    ("/v1/chat/completions", chat(logprobs="yes")),
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs="3")),
])
def test_logprobs_fields_take_their_own_types_only(app, path, body):
    r = call(app, "POST", path, body)
    assert r.status_code == 400 and "logprobs" in r.json()["error"]["message"], r.text


def _whole_and_streamed_chat(app, body):
    whole = call(app, "POST", "/v1/chat/completions", body).json()
    chunks = _stream_chunks(app, "/v1/chat/completions", body)
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    return whole["choices"][0], content, _joined_calls(chunks), chunks[-1]["choices"][0]["finish_reason"]


def test_tool_calls_with_stop_strings_whole_and_streamed_agree(app, engine):
    """Found by a second new-user trial: a stop string or stop token at </tool_call> deleted a
    required call; streamed content kept whitespace the whole answer stripped; a call cut by
    max_tokens reported finish_reason tool_calls."""
    end = engine.tokenizer.convert_tokens_to_ids("</tool_call>")
    cases = [dict(stop=["</tool_call>"]), dict(stop_token_ids=[end]), dict(stop=["celsius"]),
             dict(max_tokens=12), dict(tool_choice="auto", max_tokens=6, logit_bias={"223": 100})]
    for extra in cases:
        body = chat(tools=[WEATHER], **{"tool_choice": "required", **extra})
        whole, content, calls, finish = _whole_and_streamed_chat(app, body)
        assert content == (whole["message"]["content"] or ""), extra
        want = [c["function"] for c in whole["message"].get("tool_calls") or []]
        if finish != "tool_calls" and len(calls) > len(want):
            # A call cut short: the stream had sent its start (arguments stream as written);
            # the whole answer drops it. Its arguments are not whole JSON.
            with pytest.raises(ValueError):
                json.loads(calls.pop()["arguments"])
        assert calls == want, extra
        assert finish == whole["finish_reason"], extra
        if "stop_token_ids" in extra or extra.get("stop") == ["</tool_call>"]:
            assert whole["finish_reason"] == "tool_calls" and whole["message"]["tool_calls"], extra
        if extra.get("stop") == ["celsius"]:   # cut inside the call: no half call, no leaked markup
            assert whole["message"] == {"role": "assistant", "content": None} and whole["finish_reason"] == "stop"
        if "max_tokens" in extra:
            assert whole["finish_reason"] == "length", extra


def test_response_format_with_tools_and_refused_fields_name_themselves(app):
    body = chat(tools=[WEATHER], response_format={"type": "json_object"})
    r = call(app, "POST", "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert call(app, "POST", "/v1/chat/completions", {**body, "tool_choice": "none"}).status_code == 200
    for path, field, value in (("/v1/chat/completions", "best_of", 2), ("/v1/chat/completions", "structured_outputs",
                               {"choice": ["a"]}), ("/v1/chat/completions", "functions", [{"name": "f"}]),
                               ("/v1/completions", "response_format", {"type": "json_object"}),
                               ("/v1/completions", "skip_special_tokens", False)):
        b = chat() if path.startswith("/v1/chat") else {"model": MODEL, "prompt": "x"}
        r = call(app, "POST", path, {**b, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
    r = call(app, "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "stop": [""]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", chat(max_tokens=6)),
                                       ("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 6})])
def test_stream_options_usage(app, path, body):
    """OpenAI's stream_options: no usage unless asked; include_usage adds a last chunk with no
    choices and the totals (other chunks say usage: null); vLLM's continuous_usage_stats counts as it goes."""
    total = call(app, "POST", path, body).json()["usage"]
    assert all("usage" not in c for c in _stream_chunks(app, path, body))
    chunks = _stream_chunks(app, path, {**body, "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None and c["choices"] for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == total["completion_tokens"]
    assert chunks[-1]["usage"]["prompt_tokens"] == total["prompt_tokens"]
    chunks = _stream_chunks(app, path, {**body, "stream_options": {"include_usage": True,
                                                                   "continuous_usage_stats": True}})
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == total["completion_tokens"] and counts[0] < counts[-1]
    assert _stream_chunks(app, path, {**body, "stream_options": None})  # null means unset
    r = call(app, "POST", path, {**body, "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
    assert "only allowed when stream is true" in r.json()["error"]["message"]


def test_usage_reports_prompt_tokens_from_the_prefix_cache():
    from replicas.config import EngineConfig
    from replicas.engine import LLMEngine
    eng = LLMEngine(EngineConfig(kv_policy="pask", kv_budget=0.33, kv_cache_bytes=64 << 20, max_num_seqs=4,
                                 enable_prefix_caching=True))
    server = OpenAIServer(AsyncLLMEngine(eng), MODEL)
    app = build_app(server)
    system = {"role": "system", "content": "You answer weather questions with the tool. " * 40}
    usages = [call(app, "POST", "/v1/chat/completions", chat(
        messages=[system, {"role": "user", "content": f"Weather in {city}?"}], tools=[WEATHER], max_tokens=8)
        ).json()["usage"] for city in ("Paris", "Oslo")]
    server.engine.shutdown()
    assert usages[0]["prompt_tokens_details"] == {"cached_tokens": 0}
    shared = usages[1]["prompt_tokens_details"]["cached_tokens"]
    assert 0.8 * usages[1]["prompt_tokens"] < shared < usages[1]["prompt_tokens"] and shared % 16 == 0
