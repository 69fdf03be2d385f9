"""OpenAI-compatible request and response bodies (pydantic), with this project's extensions:
a per-request ``kv_budget`` and KV statistics in ``usage``."""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Limits(BaseModel):
    """Limits checked at the edge, before the engine (``limits`` in serve_config.yaml's args).
    Each violation is a 4xx in the OpenAI error envelope."""
    model_config = ConfigDict(extra="forbid")
    max_body_bytes: int = Field(2 << 20, gt=0, description="Request body size (413 above).")
    max_header_bytes: int = Field(32 << 10, gt=0, description="All request headers, names and values (431 "
                                  "above; Ray Serve's proxy passes headers of any size).")
    max_stop: int = Field(16, ge=0, description="Stop strings per request.")
    max_stop_chars: int = Field(256, gt=0, description="Characters per stop string.")
    max_tools: int = Field(128, ge=0, description="Tools per request.")
    max_tool_name_chars: int = Field(64, gt=0, description="Characters of a tool name.")
    max_schema_bytes: int = Field(256 << 10, gt=0, description="A JSON schema (tool parameters or response "
                                  "format), serialized.")
    max_schema_depth: int = Field(32, gt=0, description="Nesting depth of a JSON schema (objects and lists).")
    max_choices: int = Field(1024, gt=0, description="Strings of a structured_outputs choice.")


def json_depth(x: Any, limit: int) -> int:
    """Nesting depth of ``x`` (dicts and lists), counted up to ``limit + 1`` (no recursion)."""
    deepest, stack = 0, [(x, 1)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((v, d + 1) for v in (node.values() if isinstance(node, dict) else node))
    return deepest


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionDef(_Body):
    name: str = Field(min_length=1, max_length=256, description="Function name.")
    description: str | None = Field(None, description="What the function does.")
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}},
                                       description="JSON Schema of the arguments.")


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class ToolCallFunction(_Body):
    name: str
    arguments: str = Field(description="Arguments as a JSON string.")


class ToolCall(_Body):
    id: str = Field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ContentPart(BaseModel):
    """A content part; text parts are kept, others (images, audio) are refused by the model's
    template or ignored."""
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: keep the text ones
            return "".join(p.text or "" for p in self.content if p.type == "text")
        return self.content or ""


class JSONSchemaFormat(_Body):
    name: str = "response"
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema", description="The JSON Schema.")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JSONSchemaFormat | None = None


# OpenAI and vLLM request fields this server does not implement, with the values that mean "off":
# any other value is refused (400 naming the field) rather than silently ignored.
NOT_SUPPORTED: dict[str, tuple] = {
    "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1), "prompt_logprobs": (None,),
    "min_tokens": (None, 0), "allowed_token_ids": (None,), "bad_words": (None, []),
    "use_beam_search": (None, False), "length_penalty": (None, 1.0, 1), "structural_tag": (None,),
    "truncate_prompt_tokens": (None,), "return_tokens_as_token_ids": (None, False),
    "logits_processors": (None, []), "vllm_xargs": (None, {}), "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True), "priority": (None, 0),
    **{k: (None,) for k in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                            "guided_decoding_backend", "guided_whitespace_pattern", "guided_json_object")}}
CHAT_NOT_SUPPORTED: dict[str, tuple] = {
    "structured_outputs": (None,), "functions": (None,), "function_call": (None,), "chat_template": (None,),
    "chat_template_kwargs": (None, {}), "documents": (None,), "continue_final_message": (None, False),
    "add_generation_prompt": (None, True), "reasoning_effort": (None,), "prediction": (None,)}
COMPLETION_NOT_SUPPORTED: dict[str, tuple] = {"response_format": (None,), "max_completion_tokens": (None,)}
_HINTS = {"guided_": " (use structured_outputs on /v1/completions, response_format or tools on /v1/chat/completions)",
          "structured_outputs": " on chat (use response_format)", "functions": " (use tools)",
          "function_call": " (use tool_choice)", "response_format": " on completions (use structured_outputs)"}


def refuse_unsupported(data: dict, table: dict[str, tuple]) -> None:
    """Raise ValueError("<field> is not supported ...") for a field of ``table`` set to anything
    but one of its off values (of the same JSON type)."""
    for key, off in table.items():
        if key in data and not any(data[key] == v and type(data[key]) is type(v) for v in off):
            hint = next((h for k, h in _HINTS.items() if key.startswith(k)), "")
            raise ValueError(f"{key} is not supported by this server{hint}")


class StreamOptions(_Body):
    include_usage: bool = Field(False, description="Send a last chunk (no choices) with the usage; every "
                                "other chunk then has `usage: null`.")
    continuous_usage_stats: bool = Field(False, description="Extension (vLLM's): with `include_usage`, every "
                                         "chunk carries the usage so far.")


class SamplingFields(_Body):
    endpoint_not_supported: ClassVar[dict[str, tuple]] = {}   # the endpoint's own refused fields

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """An explicit null means the default, as OpenAI and vLLM take it (clients send nulls);
        a field of ``NOT_SUPPORTED`` set to anything but off is refused."""
        if isinstance(data, dict):
            refuse_unsupported(data, {**NOT_SUPPORTED, **cls.endpoint_not_supported})
            nullable = ("temperature", "top_p", "n", "stream", "parallel_tool_calls", "ignore_eos", "logprobs",
                        "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                        "logit_bias", "stop_token_ids", "include_stop_str_in_output", "stream_options")
            data = {k: v for k, v in data.items() if not (v is None and k in nullable)}
        return data

    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0 = greedy (the model's default).")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="Sample among the k most likely tokens (0 or -1: all).")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens under min_p x the top token's probability.")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, ge=0.01, le=10.0, description="> 1 discourages prompt and output tokens.")
    stop_token_ids: list[int] | None = Field(None, description="Extension (vLLM's): token ids that end generation.")
    include_stop_str_in_output: bool = Field(False, description="Extension (vLLM's): keep the stop string in the text.")
    logit_bias: dict[str, float] | None = Field(None, description="Token id (as a string) -> bias in [-100, 100], "
                                                "added to the logits.")
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1, description="Sampling seed (64-bit).")
    stop: str | list[str] | None = None
    n: Literal[1] = Field(1, description="Only one choice per request is supported.")
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description="Only with `stream` (OpenAI's).")
    ignore_eos: bool = Field(False, description="Extension (as vLLM's): keep generating past EOS (benchmarks).")
    kv_budget: float | None = Field(None, gt=0.0, le=1.0,
                                    description="Extension: total KV budget of this request (fraction of full KV).")


class ChatCompletionRequest(SamplingFields):
    endpoint_not_supported: ClassVar[dict[str, tuple]] = CHAT_NOT_SUPPORTED

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = Field(False, strict=True, description="Return each output token's log-probability (the model's "
                           "distribution, before the grammar mask and the temperature).")
    top_logprobs: int | None = Field(None, ge=0, le=20, strict=True, description="Most likely alternatives per token "
                                     "(needs `logprobs`).")


class StructuredOutputs(_Body):
    json_: dict[str, Any] | str | None = Field(None, alias="json", description="JSON Schema the output follows.")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="EBNF grammar (GBNF, `root ::= ...`) or Lark grammar "
                                "(`start: ...`; told apart by a `name ::=` rule, as vLLM does).")
    json_object: bool | None = Field(None, description="Any JSON object (vLLM's key).")


class CompletionRequest(SamplingFields):
    endpoint_not_supported: ClassVar[dict[str, tuple]] = COMPLETION_NOT_SUPPORTED

    model: str
    prompt: str | list[int] = Field(description="Text, or token ids.")
    structured_outputs: StructuredOutputs | None = None
    logprobs: int | None = Field(None, ge=0, le=20, strict=True, description="Return each output token's log-probability "
                                 "with this many most likely alternatives.")


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens whose KV came from the prefix cache (0 without it).")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    kv_bytes_peak: int = Field(description="Extension: most KV bytes the request held.")
    kv_budget_ratio_mean: float = Field(description="Extension: bytes held / full-KV bytes, mean over steps.")
    kv_budget_ratio_max: float = Field(description="Extension: the same ratio, max over steps.")
    kv_policy: str = Field(description="Extension: the KV policy (and table version) that served it.")


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = Field(None, description="Present when the model called tools.")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = Field(description="UTF-8 bytes of `token`.")


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobEntry] | None
    refusal: None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChatLogprobs | None = Field(None, description="With `logprobs`: one entry per generated token.")


class ChatCompletionResponse(BaseModel):
    """The body of a non-streaming chat completion (with ``stream``: server-sent events of
    ``chat.completion.chunk`` objects, then ``data: [DONE]``)."""
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int] = Field(description="Where each token's text starts in `text` (characters).")


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"]
    logprobs: CompletionLogprobs | None = Field(None, description="With `logprobs`: one entry per generated token.")


class CompletionResponse(BaseModel):
    """The body of a non-streaming text completion (with ``stream``: server-sent events)."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def now() -> int:
    return int(time.time())
