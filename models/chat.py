"""The embedded model's chat format (Qwen3 style) and tool-call parsing.

The model answers a tool request with one block per call, exactly the Qwen3 format that xgrammar's
``get_model_structural_tag("qwen_3", ...)`` constrains::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

or with plain text when no function fits.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

IM_START, IM_END, EOT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIAL_TOKENS = (EOT, IM_START, IM_END)
# Added (non-special) tokens: kept in decoded text, so tool calls survive skip_special_tokens.
ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<tools>", "</tools>", "<tool_response>",
                "</tool_response>")

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query. '"
    " 'Function signatures are within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a JSON object with the function name '"
    " 'and arguments within <tool_call></tool_call> XML tags.<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- if message.tool_calls %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if loop.first and message.content %}{{- '\\n' }}{%- elif not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The same format for a real Qwen3 vocabulary (models/vocab.py), plus Qwen3's switch for its
# reasoning block: ``apply_chat_template(..., enable_thinking=False)`` opens the answer with
# an empty ``<think>\n\n</think>\n\n``, as Qwen3's own non-thinking mode does.
_GENERATION_PROMPT = "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
QWEN3_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(_GENERATION_PROMPT, (
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"))

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_DECODER = json.JSONDecoder()
_WS = re.compile(r"\s*")
# The start of a call body as the grammar writes it: the name (a whole JSON string), then the
# "arguments" key, after which the arguments' own JSON text begins.
_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")(\s*,\s*"arguments"\s*:\s*)?')


def render_answer(calls: list[dict[str, Any]], text: str | None = None) -> str:
    """The assistant turn's text for ``calls`` (``[{"name", "arguments"}]``) or for plain ``text``."""
    if not calls:
        return text or ""
    return "\n".join("<tool_call>\n" + json.dumps({"name": c["name"], "arguments": c["arguments"]},
                                                  ensure_ascii=False) + "\n</tool_call>"
                     for c in calls)


@dataclass
class ParsedCall:
    """One ``<tool_call>`` block as far as the text shows it.

    Attributes:
        name: the function name, once its JSON string is whole (else None).
        arguments: the arguments' JSON text as the model wrote it, so far: while the call is open
            a prefix of its final value, which it reaches when ``complete``.
        complete: the block's JSON is whole (and closed by ``</tool_call>``, or by the end of
            the output).
        value: the parsed arguments (a dict) once complete, else None.
    """
    name: str | None = None
    arguments: str = ""
    complete: bool = False
    value: dict | None = None


@dataclass
class ParseState:
    """What :meth:`ToolCallParser.update` has read.

    Attributes:
        content: the text outside ``<tool_call>`` blocks, markup removed (a stray
            ``</tool_call>`` too); while the output runs, without a tail that could start a tag.
        calls: the complete calls in output order, then at most one open call.
        errors: why a block was dropped (malformed JSON, a body that is not a call, a cut).
    """
    content: str
    calls: list[ParsedCall]
    errors: list[str]

    @property
    def complete_calls(self) -> list[ParsedCall]:
        return [c for c in self.calls if c.complete]


class ToolCallParser:
    """Splits model output into text and Qwen3 ``<tool_call>`` blocks, incrementally.

    A block's body is read as JSON (``json.JSONDecoder.raw_decode`` after the opening tag), and
    only then is ``</tool_call>`` expected: a closing tag inside a string argument stays in the
    argument. Feed it the cumulative output text (each text a prefix of the next, as the engine
    streams it); a streamed answer and the whole answer read the same calls. Text already
    resolved (content, closed calls) is not read again.

    Args:
        unclosed_ok: at the end, accept a last block whose JSON is whole but whose closing tag
            is missing (a stop string or stop token at ``</tool_call>``).
    """

    def __init__(self, unclosed_ok: bool = True):
        self.unclosed_ok = unclosed_ok
        self._pos = 0                       # text before it is resolved into the fields below
        self._content: list[str] = []
        self._calls: list[ParsedCall] = []
        self._errors: list[str] = []

    def update(self, text: str, final: bool = False) -> ParseState:
        """Read ``text`` (the whole output so far; ``final``: the output has ended).

        Returns:
            the :class:`ParseState`: content and calls so far, an open call last.
        """
        pos, open_call = self._pos, None
        while True:
            i, j = text.find(OPEN, pos), text.find(CLOSE, pos)
            if i < 0 and j < 0:
                tail = text[pos:]
                keep = len(tail) if final else len(tail) - _tag_prefix_len(tail)
                self._content.append(tail[:keep])
                pos += keep
                break
            if j >= 0 and (i < 0 or j < i):   # a closing tag outside a call: markup, not content
                self._content.append(text[pos:j])
                pos = j + len(CLOSE)
                continue
            self._content.append(text[pos:i])
            pos = i
            status, call, end = self._read_call(text, i + len(OPEN), final)
            if status == "open":
                open_call = call
                break
            if status == "done":
                self._calls.append(call)
            else:
                self._errors.append(status)
            pos = end
        self._pos = pos
        calls = self._calls + ([open_call] if open_call is not None else [])
        return ParseState("".join(self._content), list(calls), list(self._errors))

    def _read_call(self, text: str, start: int, final: bool) -> tuple[str, ParsedCall | None, int]:
        """One block whose body starts at ``start``: ``("done", call, end)``, ``("open",
        partial call, start)`` while it may still complete, or ``(reason, None, end)`` for a block
        dropped up to ``end`` (its closing tag, or the end of the text)."""
        k = _WS.match(text, start).end()
        try:
            obj, body_end = _DECODER.raw_decode(text, k)
        except json.JSONDecodeError as e:
            if not final:     # under the grammar the text is a prefix of valid JSON: wait
                return "open", _partial(text, k), start
            return f"tool call is not valid JSON (cut short or malformed): {e.msg}", None, _skip(text, start)
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)
                and isinstance(obj.get("arguments", {}), dict)):
            if not final and text.find(CLOSE, body_end) < 0:
                return "open", ParsedCall(), start
            return "tool call is not {'name': str, 'arguments': object}", None, _skip(text, body_end)
        call = ParsedCall(obj["name"], _arguments_text(text, k, obj), True, obj.get("arguments", {}))
        after = _WS.match(text, body_end).end()
        if text.startswith(CLOSE, after):
            return "done", call, after + len(CLOSE)
        if CLOSE.startswith(text[after:]):   # the closing tag still to come, or cut off
            if not final:
                return "open", ParsedCall(call.name, call.arguments), start   # complete once closed
            if self.unclosed_ok:
                return "done", call, len(text)
            return "unterminated <tool_call> block", None, len(text)
        if not final and text.find(CLOSE, after) < 0:
            return "open", ParsedCall(), start
        return "text after a tool call's JSON before </tool_call>", None, _skip(text, after)


def _skip(text: str, start: int) -> int:
    """End of a dropped block: past its closing tag, else the end of the text."""
    j = text.find(CLOSE, start)
    return len(text) if j < 0 else j + len(CLOSE)


def _tag_prefix_len(tail: str) -> int:
    """Length of the longest end of ``tail`` that could start ``<tool_call>`` or ``</tool_call>``."""
    for k in range(min(len(CLOSE) - 1, len(tail)), 0, -1):
        end = tail[-k:]
        if OPEN.startswith(end) or CLOSE.startswith(end):
            return k
    return 0


def _partial(text: str, k: int) -> ParsedCall:
    """An open call's name (once its string is whole) and the arguments' text written so far."""
    m = _HEAD.match(text, k)
    try:
        call = ParsedCall(json.loads(m.group(1)))
    except (AttributeError, json.JSONDecodeError):   # no whole name yet, or not a JSON string
        return ParsedCall()
    a = m.end()
    if m.group(2) and a < len(text) and text[a] == "{":
        try:
            _, end = _DECODER.raw_decode(text, a)
            call.arguments = text[a:end]          # whole; the call's closing brace is still to come
        except json.JSONDecodeError:
            call.arguments = text[a:]             # not whole, so all of it belongs to the arguments
    return call


def _arguments_text(text: str, k: int, obj: dict) -> str:
    """The arguments' JSON text as written in the body at ``k`` (serialized when the body does
    not read ``{"name": ..., "arguments": {...}}`` in that order)."""
    m = _HEAD.match(text, k)
    args = obj.get("arguments", {})
    if m is not None and m.group(2):
        try:
            value, end = _DECODER.raw_decode(text, m.end())
        except json.JSONDecodeError:
            value, end = None, 0
        if value == args:
            return text[m.end():end]
    return json.dumps(args, ensure_ascii=False)


def parse_tool_calls(text: str) -> tuple[list[dict[str, Any]], str]:
    """Split model output into tool calls and remaining text.

    Returns:
        ``(calls, content)``: calls as ``[{"name": str, "arguments": dict}]`` in output order, and
        the text outside the blocks, stripped.

    Raises:
        ValueError: a ``<tool_call>`` block whose body is not ``{"name": str, "arguments": object}``
            followed by ``</tool_call>``.
    """
    state = ToolCallParser(unclosed_ok=False).update(text, final=True)
    if state.errors:
        raise ValueError(state.errors[0])
    return [{"name": c.name, "arguments": c.value} for c in state.calls], state.content.strip()
