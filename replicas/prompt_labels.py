"""Input-derived labels of prompt tokens, for PASK's prompt-side companion.

PASK (design section 4.4) calibrates the prompt (prefill) side the same way as the decode side, with
prompt tokens grouped by labels derived from the input: chat markup, system text, the tool schema's
function names, parameter keys, enum members, descriptions and schema syntax, and the user's text
and values. Labels come from the rendered prompt text (the Qwen3 tool format of ``models.chat``):
the ``<tools>`` block is lexed as JSON lines with the key path giving each string its role.

A token spanning characters of several labels takes the most specific one (the order of
:data:`PROMPT_BUCKETS`, last = most specific).
"""

from __future__ import annotations

import re

PROMPT_BUCKETS = ("chat_markup", "system_text", "history", "schema_syntax", "description", "user_text",
                  "user_value", "param_key", "enum_member", "tool_name")
NUM_PROMPT_BUCKETS = len(PROMPT_BUCKETS)
_I = {name: i for i, name in enumerate(PROMPT_BUCKETS)}

_MARKUP = re.compile(r"<\|im_start\|>(system|user|assistant|tool)?\n?|<\|im_end\|>\n?|<\|endoftext\|>|"
                     r"</?tools>|</?tool_call>|</?tool_response>")
_TURN = re.compile(r"<\|im_start\|>(system|user|assistant|tool)\n(.*?)(?=<\|im_end\|>|$)", re.S)
_TOOLS = re.compile(r"<tools>(.*?)</tools>", re.S)
# Values in a user message: numbers, quoted spans, and capitalized words after the first word.
_USER_VALUE = re.compile(r"-?\d[\d.,:/-]*|\"[^\"\n]*\"|'[^'\n]*'|(?<=[a-z,;:] )[A-Z][\w.-]*")


def _label_json(text: str, start: int, labels: list[int]) -> None:
    """Label one tool definition (a JSON object) at ``text[start:]`` in place, char by char."""
    stack: list[list] = []      # [kind, current key, expecting key?]
    i, n = start, len(text)
    while i < n:
        c = text[i]
        if c == "\n" and not stack:
            return
        top = stack[-1] if stack else None
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            is_key = top is not None and top[0] == "object" and top[2]
            path = [f[1] for f in stack]
            if is_key:
                # Keys of a "properties" object are parameter names; other keys are schema syntax.
                role = "param_key" if len(stack) >= 2 and stack[-2][1] == "properties" else "schema_syntax"
                top[1] = text[i + 1:j]
            elif path[-1:] == ["name"] and "parameters" not in path:
                role = "tool_name"
            elif "enum" in path[-1:]:
                role = "enum_member"
            elif "required" in path[-1:]:
                role = "param_key"
            elif path[-1:] == ["description"]:
                role = "description"
            else:
                role = "schema_syntax"
            for k in range(i + 1, j):
                labels[k] = _I[role]
            i = j + 1
            continue
        if c in "{[":
            # A new container starts under its parent's current key ("enum", "properties" ...).
            stack.append(["object" if c == "{" else "array", top[1] if top else None, c == "{"])
        elif c in "}]":
            if stack:
                stack.pop()
            if not stack:
                return
        elif c == ":" and top is not None:
            top[2] = False
        elif c == "," and top is not None and top[0] == "object":
            top[2] = True
        elif top is not None and top[0] == "array" and top[1] == "enum" and c not in ", \n":
            labels[i] = _I["enum_member"]   # numbers / literals in an enum
        i += 1


def label_text(text: str) -> list[int]:
    """Per-character prompt bucket ids (indices into :data:`PROMPT_BUCKETS`) of a rendered prompt."""
    labels = [_I["history"]] * len(text)
    for m in _TURN.finditer(text):
        role, body_start, body_end = m.group(1), m.start(2), m.end(2)
        base = {"system": "system_text", "user": "user_text"}.get(role, "history")
        for k in range(body_start, body_end):
            labels[k] = _I[base]
        if role == "user":
            for v in _USER_VALUE.finditer(text, body_start, body_end):
                for k in range(v.start(), v.end()):
                    labels[k] = _I["user_value"]
    for m in _TOOLS.finditer(text):
        body, end = m.start(1), m.end(1)
        for k in range(body, end):
            labels[k] = _I["schema_syntax"]
        pos = body
        while pos < end:
            brace = text.find("{", pos, end)
            if brace < 0:
                break
            _label_json(text, brace, labels)
            nl = text.find("\n", brace, end)
            pos = end if nl < 0 else nl + 1
    for m in _MARKUP.finditer(text):
        for k in range(m.start(), m.end()):
            labels[k] = _I["chat_markup"]
    return labels


def prompt_labels(tokenizer, token_ids: list[int]) -> list[int]:
    """Prompt bucket id of every prompt token.

    Args:
        tokenizer: a Hugging Face tokenizer (fast, byte-level BPE).
        token_ids: the prompt's token ids, ``[n]``.
    Returns ``[n]`` ints in ``[0, NUM_PROMPT_BUCKETS)``.
    """
    # Character spans: every token decoded alone. A byte-level token may hold part of a multi-byte character and decode to U+FFFD;
    # its span is then approximate by at most one character, which only matters inside that text.
    spans, text_parts, pos = [], [], 0
    for tid in token_ids:
        piece = tokenizer.decode([tid])
        spans.append((pos, pos + len(piece)))
        text_parts.append(piece)
        pos += len(piece)
    labels = label_text("".join(text_parts))
    out = []
    for start, end in spans:
        out.append(max(labels[start:end], default=_I["chat_markup"]))
    return out
