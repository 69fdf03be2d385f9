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

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def render_answer(calls: list[dict[str, Any]], text: str | None = None) -> str:
    """The assistant turn's text for ``calls`` (``[{"name", "arguments"}]``) or for plain ``text``."""
    if not calls:
        return text or ""
    return "\n".join("<tool_call>\n" + json.dumps({"name": c["name"], "arguments": c["arguments"]},
                                                  ensure_ascii=False) + "\n</tool_call>"
                     for c in calls)


def parse_tool_calls(text: str) -> tuple[list[dict[str, Any]], str]:
    """Split model output into tool calls and remaining text.

    Returns:
        ``(calls, content)``: calls as ``[{"name": str, "arguments": dict}]`` in output order, and
        the text outside the blocks, stripped.

    Raises:
        ValueError: a ``<tool_call>`` block whose body is not ``{"name": str, "arguments": object}``.
    """
    calls = []
    for body in _TOOL_CALL.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            raise ValueError(f"tool call is not valid JSON: {e.msg} in {body[:80]!r}") from None
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)
                and isinstance(obj.get("arguments", {}), dict)):
            raise ValueError(f"tool call must be {{'name': str, 'arguments': object}}: {body[:80]!r}")
        calls.append({"name": obj["name"], "arguments": obj.get("arguments", {})})
    content = _TOOL_CALL.sub("", text)
    if "<tool_call>" in content:
        raise ValueError("unterminated <tool_call> block")
    return calls, content.strip()
