"""The OpenAI-compatible HTTP API over an :class:`AsyncLLMEngine` (FastAPI).

``build_app(server)`` returns the FastAPI app; the ingress deployment in :mod:`cluster.app` mounts
it over a client of the engine replicas, and tests use it in-process over an :class:`OpenAIServer`. Routes: ``POST /v1/chat/completions``,
``POST /v1/completions``, ``GET /v1/models``, ``GET /health``. Errors use the OpenAI envelope
``{"error": {"message", "type", "param", "code"}}``. With an API key set, every ``/v1`` route needs
``Authorization: Bearer <key>`` (401 otherwise), as vLLM's ``--api-key``; ``/health`` stays open.
"""

from __future__ import annotations

import hmac
import json
import re
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse,
                              ErrorResponse, Limits, ModelList, NamedToolChoice, SamplingFields, ToolCall,
                              ToolCallFunction, Usage, json_depth, now)
from models import chat
from replicas.async_engine import AsyncLLMEngine, EngineDeadError
from replicas.errors import GrammarCompileError, InvalidRequestError
from replicas.grammar import GrammarSpec
from replicas.sampling_params import SamplingParams
from replicas.detokenizer import IncrementalDetokenizer, token_bytes_of
from replicas.sequence import RequestOutput, TokenLogprob


EBNF_RULE = re.compile(r"^\s*[A-Za-z_][\w.-]*\s*::=", re.MULTILINE)
TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]+")  # OpenAI's [a-zA-Z0-9_-], plus . and : (BFCL names have dots)


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers

    def __reduce__(self):  # crosses process boundaries whole (Ray Serve: replica -> ingress)
        return (type(self), (self.status, self.message, self.type, self.param, self.headers))


def error_body(status: int, message: str, type_: str, param: str | None = None) -> dict:
    """The OpenAI error envelope."""
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, type_, param), status_code=status, headers=headers)


def error_event(e: "APIError") -> str:
    """A final server-sent event that ends a stream with ``e`` in the error envelope."""
    return _sse(error_body(e.status, e.message, e.type, e.param))


class APIMetrics:
    """Per-request metrics through ``ray.util.metrics`` (Ray dashboard, Prometheus names with a
    ``ray_`` prefix); a no-op where Ray is not initialized (the API in-process).

    ``structkv_requests`` {finish_reason}, ``structkv_prompt_tokens``, ``structkv_prompt_tokens_cached``
    (from the prefix cache), ``structkv_generation_tokens``,
    ``structkv_ttft_seconds`` and ``structkv_inter_token_latency_seconds`` (histograms),
    ``structkv_request_kv_bytes_peak``, ``structkv_request_kv_ratio`` (achieved bytes held / full KV,
    max over the request: histogram), ``structkv_grammar_compile_failures``, ``structkv_request_errors``
    {status}.
    """

    LATENCY_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]
    RATIO = [0.05, 0.1, 0.15, 0.2, 0.25, 0.33, 0.5, 0.75, 1.0]

    def __init__(self, model: str):
        self.tags, self.m = {"model": model}, None
        try:
            import ray
            if not ray.is_initialized():
                return
            from ray.util import metrics as rm
        except ImportError:
            return
        t = ("model",)
        self.m = {
            "requests": rm.Counter("structkv_requests", "Finished requests", tag_keys=t + ("finish_reason",)),
            "errors": rm.Counter("structkv_request_errors", "Requests answered with an error", tag_keys=t + ("status",)),
            "prompt": rm.Counter("structkv_prompt_tokens", "Prompt tokens", tag_keys=t),
            "cached": rm.Counter("structkv_prompt_tokens_cached", "Prompt tokens whose KV came from the prefix cache",
                                 tag_keys=t),
            "generation": rm.Counter("structkv_generation_tokens", "Generated tokens", tag_keys=t),
            "ttft": rm.Histogram("structkv_ttft_seconds", "Time to first token", boundaries=self.LATENCY_S, tag_keys=t),
            "itl": rm.Histogram("structkv_inter_token_latency_seconds", "Mean inter-token latency of a request",
                                boundaries=self.LATENCY_S, tag_keys=t),
            "ratio": rm.Histogram("structkv_request_kv_ratio", "KV bytes held / full KV bytes, max over a request",
                                  boundaries=self.RATIO, tag_keys=t),
            "kv_bytes": rm.Gauge("structkv_request_kv_bytes_peak", "KV bytes held by the last finished request",
                                 tag_keys=t),
            "grammar": rm.Counter("structkv_grammar_compile_failures", "Grammars that did not compile", tag_keys=t)}

    def finished(self, out: RequestOutput) -> None:
        if self.m is None:
            return
        m, n = out.metrics, out.num_output_tokens
        self.m["requests"].inc(1, {**self.tags, "finish_reason": out.finish_reason or "unknown"})
        self.m["prompt"].inc(out.num_prompt_tokens, self.tags)
        if m.num_cached_tokens:
            self.m["cached"].inc(m.num_cached_tokens, self.tags)
        if n:
            self.m["generation"].inc(n, self.tags)
        if m.first_token_s is not None:
            self.m["ttft"].observe(m.first_token_s - m.arrival_s, self.tags)
            if n > 1 and m.finished_s is not None:
                self.m["itl"].observe((m.finished_s - m.first_token_s) / (n - 1), self.tags)
        self.m["ratio"].observe(m.kv_ratio_max, self.tags)
        self.m["kv_bytes"].set(m.kv_bytes_peak, self.tags)

    def error(self, status: int) -> None:
        """Any request answered with an error (called by the app's error handlers)."""
        if self.m is not None:
            self.m["errors"].inc(1, {**self.tags, "status": str(status)})

    def grammar_failure(self) -> None:
        if self.m is not None:
            self.m["grammar"].inc(1, self.tags)


class OpenAIServer:
    """Turns OpenAI requests into engine requests and engine outputs into OpenAI responses.

    Args:
        engine: the replica's engine.
        model_name: the id clients send as ``model``.
        max_pending: requests in flight beyond which new ones get 429 with Retry-After.
        api_key: when set, the bearer token every ``/v1`` request must carry.
        limits: request limits checked before the engine (:class:`cluster.protocol.Limits`).
    """

    def __init__(self, engine: AsyncLLMEngine, model_name: str, max_pending: int = 256,
                 api_key: str | None = None, limits: Limits | None = None):
        self.engine, self.model_name, self.max_pending = engine, model_name, max_pending
        self.limits = limits or Limits()
        self.api_key = api_key or None
        self.metrics = APIMetrics(model_name)
        self.tokenizer = engine.engine.tokenizer
        self.logprobs = LogprobFormatter(self.tokenizer)
        self.pending = 0

    # ------------------------------------------------------------------ request -> engine
    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                           "not_found_error", "model")

    def _check_schema(self, schema: Any, param: str) -> Any:
        """Size and nesting limits of a schema (a JSON string is parsed first). Returns the schema
        parsed."""
        lim = self.limits
        if isinstance(schema, str):
            if len(schema.encode("utf-8", "surrogatepass")) > lim.max_schema_bytes:
                raise APIError(400, f"{param}: schema of {len(schema)} characters is over the limit of "
                                    f"{lim.max_schema_bytes} bytes", param=param)
            depth = _bracket_depth(schema)
            if depth > lim.max_schema_depth:
                raise APIError(400, f"{param}: schema nested deeper than {lim.max_schema_depth} levels", param=param)
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError) as e:
                raise APIError(400, f"{param}: not valid JSON: {e}", param=param) from None
        size = len(json.dumps(schema))
        if size > lim.max_schema_bytes:
            raise APIError(400, f"{param}: schema of {size} bytes is over the limit of {lim.max_schema_bytes}",
                           param=param)
        depth = json_depth(schema, lim.max_schema_depth)
        if depth > lim.max_schema_depth:
            raise APIError(400, f"{param}: schema nested deeper than {lim.max_schema_depth} levels", param=param)
        return schema

    def _check_tools(self, req: ChatCompletionRequest) -> None:
        lim, tools = self.limits, req.tools or []
        if len(tools) > lim.max_tools:
            raise APIError(400, f"{len(tools)} tools, over the limit of {lim.max_tools}", param="tools")
        seen = set()
        for i, t in enumerate(tools):
            name = t.function.name
            if len(name) > lim.max_tool_name_chars:
                raise APIError(400, f"tools[{i}].function.name is {len(name)} characters, over the "
                                    f"limit of {lim.max_tool_name_chars}", param=f"tools[{i}].function.name")
            if not TOOL_NAME.fullmatch(name):  # the name goes into the grammar and the call markup as is
                raise APIError(400, f"tools[{i}].function.name {name!r} may only hold letters, digits and _ - . :",
                               param=f"tools[{i}].function.name")
            if name in seen:
                raise APIError(400, f"tools[{i}].function.name {name!r} is given twice", param=f"tools[{i}].function.name")
            seen.add(name)
            self._check_schema(t.function.parameters, f"tools[{i}].function.parameters")

    def _sampling(self, req: SamplingFields, max_tokens: int | None, num_prompt: int,
                  logprobs: int | None = None) -> SamplingParams:
        context = self.engine.engine.max_model_len
        room = context - num_prompt
        if room < 1:
            raise APIError(400, f"prompt of {num_prompt} tokens leaves no room in the context of "
                                f"{context} tokens", param="messages")
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        if len(stop) > self.limits.max_stop or any(len(x) > self.limits.max_stop_chars for x in stop):
            raise APIError(400, f"stop takes at most {self.limits.max_stop} strings of at most "
                                f"{self.limits.max_stop_chars} characters", param="stop")
        keys = list(req.logit_bias or {})
        if any(not (k.isascii() and k.isdigit()) for k in keys) or len({int(k) for k in keys}) < len(keys):
            raise APIError(400, "logit_bias keys must be distinct token ids written as decimal digits", param="logit_bias")
        bias = tuple((int(t), b) for t, b in (req.logit_bias or {}).items())
        try:
            return SamplingParams(max_tokens=max_tokens or min(room, 1024), temperature=req.temperature,
                                  top_p=req.top_p, seed=req.seed, stop=stop, ignore_eos=req.ignore_eos,
                                  top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty,
                                  presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                                  logit_bias=bias, logprobs=logprobs, stop_token_ids=tuple(req.stop_token_ids or ()),
                                  include_stop_str_in_output=req.include_stop_str_in_output)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=e.param) from None

    def chat_request(self, req: ChatCompletionRequest) -> tuple[list[int], SamplingParams, GrammarSpec | None,
                                                               str | None]:
        """Prompt ids, sampling, grammar, and what is done with ``<tool_call>`` markup in the
        output: ``"calls"`` (parsed into tool calls), ``"strip"`` (``tool_choice: "none"`` with
        tools and no grammar: removed from the content, as vLLM does) or None (plain text)."""
        self._check_model(req.model)
        self._check_tools(req)
        tools = [t.model_dump() for t in req.tools] if req.tools else None
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
        if isinstance(choice, NamedToolChoice):
            if not tools or choice.function.name not in {t["function"]["name"] for t in tools}:
                raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools",
                               param="tool_choice")
            choice = choice.model_dump()
        elif choice in ("auto", "required") and not tools:
            if req.tool_choice is not None:
                raise APIError(400, f"tool_choice {choice!r} needs tools", param="tool_choice")
        messages = []
        for i, m in enumerate(req.messages):
            _check_text(m.text(), f"messages[{i}].content")
            msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.tool_calls:
                msg["tool_calls"] = [{"type": "function", "function": {
                    "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in m.tool_calls]
            messages.append(msg)
        try:
            ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                     return_dict=True)["input_ids"]
        except Exception as e:  # a template error is the request's fault (e.g. bad roles order)
            raise APIError(400, f"messages cannot be rendered: {e}", param="messages") from None
        grammar, tools_mode = None, None
        if tools and choice != "none" and req.response_format and req.response_format.type != "text":
            raise APIError(400, "response_format cannot be combined with tools unless tool_choice is \"none\" "
                                "(one grammar per request)", param="response_format")
        if tools and choice != "none":
            grammar = GrammarSpec("tools", {"tools": tools, "tool_choice": choice,
                                            "parallel_tool_calls": req.parallel_tool_calls})
            tools_mode = "calls"
        elif req.response_format and req.response_format.type == "json_schema":
            if req.response_format.json_schema is None:
                raise APIError(400, "response_format json_schema needs a json_schema", param="response_format")
            self._check_schema(req.response_format.json_schema.schema_, "response_format.json_schema.schema")
            grammar = GrammarSpec("json_schema", req.response_format.json_schema.schema_,
                                  strict=bool(req.response_format.json_schema.strict))
        elif req.response_format and req.response_format.type == "json_object":
            grammar = GrammarSpec("json_object")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        params = self._sampling(req, req.max_completion_tokens or req.max_tokens, len(ids),
                                (req.top_logprobs or 0) if req.logprobs else None)
        if tools and choice == "none" and grammar is None:
            tools_mode = "strip"
        return ids, params, grammar, tools_mode

    def completion_request(self, req: CompletionRequest):
        self._check_model(req.model)
        if isinstance(req.prompt, str):
            _check_text(req.prompt, "prompt")
            ids = self.tokenizer(req.prompt, add_special_tokens=False)["input_ids"]
        else:
            ids = list(req.prompt)
        so, grammar = req.structured_outputs, None
        if so is not None:
            given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(so, k) is not None]
            if so.json_object:
                given.append("json_object")
            if len(given) > 1:
                raise APIError(400, "structured_outputs takes one of json, regex, choice, grammar, json_object",
                               param="structured_outputs")
            if given == ["json_object"]:
                grammar = GrammarSpec("json_object")
            elif given:
                kind = {"json_": "json_schema", "regex": "regex", "choice": "choice", "grammar": "ebnf"}[given[0]]
                value, param = getattr(so, given[0]), f"structured_outputs.{given[0].rstrip('_')}"
                if kind == "ebnf" and not EBNF_RULE.search(value):
                    kind = "lark"  # no `name ::=` rule: Lark (`name: ...`), as vLLM tells the two apart
                if kind == "choice" and len(value) > self.limits.max_choices:
                    raise APIError(400, f"structured_outputs.choice has {len(value)} strings, over the limit of "
                                        f"{self.limits.max_choices}", param="structured_outputs.choice")
                if kind == "json_schema":
                    value = self._check_schema(value, param)
                else:
                    size = len(json.dumps(value))
                    if size > self.limits.max_schema_bytes:
                        raise APIError(400, f"{param}: {size} bytes, over the limit of {self.limits.max_schema_bytes}",
                                       param=param)
                    for text in (value if isinstance(value, list) else [value]):
                        _check_text(text, param)
                grammar = GrammarSpec(kind, value)
        return ids, self._sampling(req, req.max_tokens, len(ids), req.logprobs), grammar

    # ------------------------------------------------------------------ running
    async def run(self, ids, params, grammar, kv_budget, grammar_param: str = "response_format"
                  ) -> AsyncIterator[RequestOutput]:
        if self.pending >= self.max_pending:
            raise APIError(429, "the replica's queue is full; retry later", "rate_limit_error",
                           headers={"Retry-After": "1"})
        self.pending += 1
        try:
            async for out in self.engine.generate(ids, params, f"req-{uuid.uuid4().hex}", grammar, kv_budget):
                if out.finished:
                    self.metrics.finished(out)
                yield out
        except GrammarCompileError as e:
            self.metrics.grammar_failure()
            raise APIError(400, str(e), param="tools" if grammar is not None and grammar.kind == "tools"
                           else grammar_param) from None
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=getattr(e, "param", None)) from None
        except EngineDeadError as e:
            raise APIError(503, str(e), "service_unavailable", headers={"Retry-After": "1"}) from None
        finally:
            self.pending -= 1

    # ------------------------------------------------------------------ responses
    async def chat(self, req: ChatCompletionRequest) -> AsyncIterator[dict | str]:
        """Answer one chat completion: yields the response body (one dict), or with ``stream`` the
        server-sent events (str, ``data: ...\\n\\n``) up to ``data: [DONE]``.

        Raises:
            APIError: before the first item, for anything the request got wrong (4xx) or a full
                queue (429) or a failed engine (503); later failures end the stream with an error event.
        """
        usage = _StreamUsage(self, req)
        ids, params, grammar, tools_mode = self.chat_request(req)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", now()
        stream = self.run(ids, params, grammar, req.kv_budget)
        first = await _first(stream)
        if req.stream:
            async for event in _chat_stream(self, rid, created, req.model, first, stream, tools_mode, usage):
                yield event
            return
        out = first
        async for out in stream:
            pass
        message, has_calls = _message(out, tools_mode)
        yield {"id": rid, "object": "chat.completion", "created": created, "model": req.model,
               "choices": [{"index": 0, "message": message, "finish_reason": _finish_reason(out, has_calls),
                            "logprobs": self.logprobs.chat(out.logprobs)}], "usage": self.usage(out)}

    async def completion(self, req: CompletionRequest) -> AsyncIterator[dict | str]:
        """Answer one text completion, as :meth:`chat` does."""
        usage = _StreamUsage(self, req)
        ids, params, grammar = self.completion_request(req)
        rid, created = f"cmpl-{uuid.uuid4().hex}", now()
        stream = self.run(ids, params, grammar, req.kv_budget, "structured_outputs")
        first = await _first(stream)
        if req.stream:
            async for event in _completion_stream(self, rid, created, req.model, first, stream, usage):
                yield event
            return
        out = first
        async for out in stream:
            pass
        yield {"id": rid, "object": "text_completion", "created": created, "model": req.model,
               "choices": [{"index": 0, "text": out.text, "finish_reason": _finish_reason(out, False),
                            "logprobs": self.logprobs.completion(out.logprobs)}], "usage": self.usage(out)}

    def open(self, kind: str, req) -> AsyncIterator[dict | str]:
        """The frontend interface of :func:`build_app`: ``kind`` is ``chat`` or ``completion``."""
        return self.chat(req) if kind == "chat" else self.completion(req)

    async def health(self) -> None:
        """Raises APIError(503) unless the engine loop comes round within 30 s."""
        try:
            await self.engine.ping(30.0)
        except EngineDeadError as e:
            raise APIError(503, str(e), "service_unavailable", headers={"Retry-After": "5"}) from None

    def usage(self, out: RequestOutput) -> dict:
        m = out.metrics
        return Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens,
                     total_tokens=out.num_prompt_tokens + out.num_output_tokens,
                     prompt_tokens_details={"cached_tokens": m.num_cached_tokens}, kv_bytes_peak=m.kv_bytes_peak,
                     kv_budget_ratio_mean=round(m.kv_ratio_mean, 6), kv_budget_ratio_max=round(m.kv_ratio_max, 6),
                     kv_policy=self._policy_label()).model_dump()

    def _policy_label(self) -> str:
        """The policy name, with the table versions it serves (``pask@v2``)."""
        versions = self.engine.engine.table_versions
        name = self.engine.engine.policy.name
        return name + "".join(f" {k}@{v}" for k, v in sorted(versions.items()))


def _check_text(text: str, param: str) -> None:
    """400 for text that is not valid Unicode (a lone surrogate, which JSON can carry)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param}: not valid Unicode ({e.reason} at character {e.start})", param=param) from None


def _bracket_depth(text: str) -> int:
    """Deepest nesting of [ and { in JSON text, outside strings (no recursion, no parse)."""
    depth = deepest = 0
    in_str = escaped = False
    for ch in text:
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (TypeError, json.JSONDecodeError):
        return arguments


class LogprobFormatter:
    """Log-probabilities in OpenAI's two shapes. Each token is shown as it decodes alone (a piece
    of a character split across tokens shows as U+FFFD), as vLLM shows it; ``bytes`` are the
    token's own bytes (byte-level BPE vocabularies), so a client can join them into the characters
    split across tokens, as OpenAI means them (other vocabularies: the shown text's UTF-8)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.token_bytes = token_bytes_of(tokenizer)   # for TextOffsets: one decode a token
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_of = None
        if type(decoder).__name__ == "ByteLevel":
            from transformers.convert_slow_tokenizer import bytes_to_unicode
            self._byte_of = {c: b for b, c in bytes_to_unicode().items()}

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _bytes(self, token_id: int, text: str) -> list[int]:
        if self._byte_of is not None:
            symbols = self.tokenizer.convert_ids_to_tokens(token_id)
            if symbols and all(c in self._byte_of for c in symbols):
                return [self._byte_of[c] for c in symbols]
        return list(text.encode())

    def _top(self, token_id: int, logprob: float) -> dict:
        text = self._text(token_id)
        return {"token": text, "logprob": logprob, "bytes": self._bytes(token_id, text)}

    def chat(self, entries: list[TokenLogprob] | None) -> dict | None:
        """``choices[].logprobs`` of a chat completion (or chunk): ``{"content": [...]}``."""
        if entries is None:
            return None
        return {"content": [{**self._top(e.token_id, e.logprob), "top_logprobs": [self._top(i, lp) for i, lp in e.top]}
                            for e in entries], "refusal": None}

    def completion(self, entries: list[TokenLogprob] | None, offsets: "TextOffsets | None" = None) -> dict | None:
        """``choices[].logprobs`` of a text completion: tokens, token_logprobs, top_logprobs
        (token text -> logprob, the sampled token included) and text_offset (characters;
        ``offsets`` carries the position over the chunks of a stream)."""
        if entries is None:
            return None
        offsets = offsets or TextOffsets(self.tokenizer, self.token_bytes)
        return {"tokens": [self._text(e.token_id) for e in entries],
                "token_logprobs": [e.logprob for e in entries],
                # The sampled token is always among them (OpenAI's legacy format: up to N + 1).
                "top_logprobs": [{**{self._text(i): lp for i, lp in e.top}, self._text(e.token_id): e.logprob}
                                 for e in entries],
                "text_offset": [offsets.next(e.token_id) for e in entries]}


class TextOffsets:
    """Where each next token's text starts in the output text (characters)."""

    def __init__(self, tokenizer, token_bytes=None):
        self._detok = IncrementalDetokenizer(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), token_bytes)

    def next(self, token_id: int) -> int:
        at = len(self._detok.text)
        self._detok.add(token_id)
        return at


def _finish_reason(out: RequestOutput, has_calls: bool) -> str:
    """``length`` whenever max_tokens or the context cut the output (calls before the cut are
    still returned), else ``tool_calls`` when there are calls, else ``stop``."""
    if out.finish_reason == "length":
        return "length"
    return "tool_calls" if has_calls else "stop"


def _message(out: RequestOutput, tools_mode: str | None) -> tuple[dict, bool]:
    """The whole answer's message, and whether it has tool calls."""
    if tools_mode is None:
        return {"role": "assistant", "content": out.text}, False
    # A call cut short (max_tokens, a stop string) is dropped, not leaked as content; a last call
    # whose JSON is whole but whose closing tag is missing (a stop string or stop token at
    # </tool_call>) is kept, as vLLM's Hermes parser does.
    state = chat.ToolCallParser().update(out.text, final=True)
    content = state.content.strip() or None
    calls = state.complete_calls if tools_mode == "calls" else []
    if calls:
        tool_calls = [ToolCall(function=ToolCallFunction(name=c.name, arguments=c.arguments)).model_dump()
                      for c in calls]
        return {"role": "assistant", "content": content, "tool_calls": tool_calls}, True
    return {"role": "assistant", "content": content}, False


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def build_app(server) -> FastAPI:
    """The FastAPI app over a frontend: an :class:`OpenAIServer` in the same process (tests, one
    process), or ``cluster.app.EngineClient`` that reaches the engine replicas through a Ray Serve
    handle. A frontend has ``model_name``, ``limits``, ``api_key``, ``metrics``, ``open(kind, req)``
    (``kind`` chat or completion: an async iterator of one response dict or of SSE strings, raising
    :class:`APIError` before its first item) and ``async health()``.
    """
    app = FastAPI(title="structkv", description="OpenAI-compatible structured generation with a compressed KV cache")

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        server.metrics.error(exc.status)
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        """Unknown routes (404), wrong methods (405) and the like, in the same envelope."""
        server.metrics.error(exc.status_code)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind,
                              None, getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        server.metrics.error(400)
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":   # loc is ("body", character offset)
            at = first.get("loc", ("body", "?"))[-1]
            detail = (first.get("ctx") or {}).get("error", "JSON decode error")
            return error_response(400, f"the request body is not valid JSON ({detail} at character {at})",
                                  "invalid_request_error", None)
        if first.get("loc") == ("body",) and first.get("type") == "model_attributes_type":
            return error_response(400, "the request body must be a JSON object, sent with "
                                       "Content-Type: application/json", "invalid_request_error", None)
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        refused = re.match(r"Value error, (\w+) is not supported", first.get("msg", ""))
        where = where or (refused.group(1) if refused else "")
        return error_response(400, f"invalid request body at {where or 'body'}: {first.get('msg', 'malformed')}",
                              "invalid_request_error", where or None)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        """A bug, not the client's fault: 500 in the envelope (logged with its traceback), never a
        plain-text page."""
        import logging
        logging.getLogger("structkv").exception("internal error on %s %s", request.method, request.url.path)
        server.metrics.error(500)
        return error_response(500, f"internal error: {type(exc).__name__}", "internal_server_error")

    max_body = server.limits.max_body_bytes
    max_header = server.limits.max_header_bytes

    @app.middleware("http")
    async def _limit_body(request: Request, call_next):
        """431 for headers over the limit; 413 for a body over the limit: by Content-Length, else
        by the body read (and kept for the route)."""
        header_bytes = sum(len(k) + len(v) for k, v in request.scope.get("headers", ()))
        if header_bytes > max_header:
            server.metrics.error(431)
            return error_response(431, f"request headers of {header_bytes} bytes are over the limit of "
                                       f"{max_header} bytes", "invalid_request_error")
        if request.method in ("POST", "PUT", "PATCH"):
            declared = request.headers.get("content-length")
            if declared is not None and declared.isdigit():
                too_big = int(declared) > max_body
            else:
                too_big = len(await request.body()) > max_body
            if too_big:
                server.metrics.error(413)
                return error_response(413, f"request body over the limit of {max_body} bytes",
                                      "invalid_request_error")
        return await call_next(request)

    if server.api_key:
        expected = f"Bearer {server.api_key}".encode()

        @app.middleware("http")
        async def _require_api_key(request: Request, call_next):
            if request.url.path.startswith("/v1"):
                given = request.headers.get("authorization", "").encode()
                if not hmac.compare_digest(given, expected):
                    server.metrics.error(401)
                    return error_response(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                          "authentication_error", None, {"WWW-Authenticate": "Bearer"})
            return await call_next(request)

    def documented(ok_model=None, stream: bool = False, *errors: int) -> dict:
        """OpenAPI responses of a route (documentation only: bodies are sent as built)."""
        out: dict = {code: {"model": ErrorResponse} for code in errors}
        if ok_model is not None:
            out[200] = {"model": ok_model, **({"content": {"text/event-stream": {}}} if stream else {})}
        return out

    api_errors = (400, 401, 404, 413, 429, 431, 503)

    @app.get("/health", responses=documented(None, False, 503))
    async def health():
        """200 once the engine loop comes round between steps (vLLM's /health); 503 otherwise."""
        await server.health()
        return {"status": "ok"}

    @app.get("/v1/models", response_model=ModelList, responses=documented(None, False, 401))
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": now(),
                                            "owned_by": "structkv"}]}

    async def respond(kind: str, req):
        items = server.open(kind, req)
        first = await items.__anext__()  # request errors surface here, before a response starts
        if isinstance(first, dict):
            await items.aclose()
            return first
        return StreamingResponse(_outputs(first, items), media_type="text/event-stream")

    @app.post("/v1/chat/completions", responses=documented(ChatCompletionResponse, True, *api_errors))
    async def chat_completions(req: ChatCompletionRequest):
        return await respond("chat", req)

    @app.post("/v1/completions", responses=documented(CompletionResponse, True, *api_errors))
    async def completions(req: CompletionRequest):
        return await respond("completion", req)

    return app


async def _first(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The first output: request errors surface here, before a streaming response starts."""
    return await stream.__anext__()


async def _outputs(first, stream):
    yield first
    async for out in stream:
        yield out


class _LogprobCursor:
    """A stream's log-probabilities not sent yet (tokens whose text is held back go with a later
    chunk), gathered from the outputs' deltas by :meth:`take`, rendered by ``render`` into a
    chunk's ``logprobs``."""

    def __init__(self, render):
        self.render, self.pending, self.asked = render, [], False

    def take(self, out: RequestOutput) -> None:
        if out.new_logprobs is not None:
            self.asked = True
            self.pending += out.new_logprobs

    def __call__(self, only_if_left: bool = False) -> dict:
        if not self.asked or (only_if_left and not self.pending):
            return {}
        entries, self.pending = self.pending, []
        return {"logprobs": self.render(entries)}


class _StreamUsage:
    """OpenAI's ``stream_options``: without ``include_usage`` no chunk carries usage; with it every
    chunk has ``usage: null`` (the counts so far with vLLM's ``continuous_usage_stats``) and a last
    chunk with no choices carries the request's usage.

    Raises:
        APIError: 400 for ``stream_options`` on a request that does not stream (as OpenAI and vLLM).
    """

    def __init__(self, server, req):
        options = req.stream_options
        if options is not None and not req.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        self.server = server
        self.include = bool(options and options.include_usage)
        self.continuous = self.include and options.continuous_usage_stats

    def chunk(self, body: dict, out: RequestOutput) -> str:
        if self.include:
            body["usage"] = self.server.usage(out) if self.continuous else None
        return _sse(body)

    def last(self, base: dict, out: RequestOutput) -> list[str]:
        return [_sse({**base, "choices": [], "usage": self.server.usage(out)})] if self.include else []


class _ToolCallDeltas:
    """A stream's tool calls as OpenAI and vLLM stream them: a call's first delta carries its
    ``index``, ``id``, ``type`` and ``function.name`` (``arguments: ""``), then ``function.arguments``
    fragments follow as the model writes them; their concatenation is the whole answer's
    ``arguments``. A call cut short has sent its start (``finish_reason`` says ``length`` or ``stop``)."""

    def __init__(self):
        self.sent: list[int] = []    # per call index: characters of arguments sent

    def __call__(self, calls: list[chat.ParsedCall]) -> list[dict]:
        deltas = []
        for i, c in enumerate(calls):
            if c.name is None:
                break
            if i == len(self.sent):
                start = ToolCall(function=ToolCallFunction(name=c.name, arguments="")).model_dump()
                deltas.append({"index": i, **start})
                self.sent.append(0)
            if len(c.arguments) > self.sent[i]:
                deltas.append({"index": i, "function": {"arguments": c.arguments[self.sent[i]:]}})
                self.sent[i] = len(c.arguments)
        return deltas


async def _chat_stream(server, rid, created, model, first, stream, tools_mode, usage: _StreamUsage):
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    yield usage.chunk({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                            "finish_reason": None}]}, first)
    sent, out, logprobs, text = 0, first, _LogprobCursor(server.logprobs.chat), ""
    parser, tool_deltas, has_calls = chat.ToolCallParser(), _ToolCallDeltas(), False

    try:
        async for out in _outputs(first, stream):
            logprobs.take(out)
            text += out.new_text
            deltas: list[dict] = []
            if tools_mode is None:
                visible = text
            else:
                # Content goes out as the text outside <tool_call> blocks, stripped as the whole
                # answer's is (trailing whitespace waits); calls stream as they are written.
                state = parser.update(text, final=out.finished)
                visible = state.content.strip()
                if tools_mode == "calls":
                    deltas = [{"tool_calls": [d]} for d in tool_deltas(state.calls)]
                    has_calls = bool(state.complete_calls)
            if len(visible) > sent:
                deltas.insert(0, {"content": visible[sent:]})
                sent = len(visible)
            for k, delta in enumerate(deltas):   # the step's log-probabilities go with its first chunk
                yield usage.chunk({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None,
                                                        **logprobs(only_if_left=k > 0)}]}, out)
    except APIError as e:
        yield error_event(e)
        return
    yield usage.chunk({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": _finish_reason(out, has_calls),
                                            **logprobs(only_if_left=True)}]}, out)
    for event in usage.last(base, out):
        yield event
    yield "data: [DONE]\n\n"


async def _completion_stream(server, rid, created, model, first, stream, usage: _StreamUsage):
    base = {"id": rid, "object": "text_completion", "created": created, "model": model}
    offsets = TextOffsets(server.tokenizer, server.logprobs.token_bytes)
    out, logprobs = first, _LogprobCursor(lambda entries: server.logprobs.completion(entries, offsets))

    try:
        async for out in _outputs(first, stream):
            logprobs.take(out)
            if out.new_text:
                yield usage.chunk({**base, "choices": [{"index": 0, "text": out.new_text, "finish_reason": None,
                                                        **logprobs()}]}, out)
    except APIError as e:
        yield error_event(e)
        return
    yield usage.chunk({**base, "choices": [{"index": 0, "text": "", "finish_reason": _finish_reason(out, False),
                                            **logprobs(only_if_left=True)}]}, out)
    for event in usage.last(base, out):
        yield event
    yield "data: [DONE]\n\n"
