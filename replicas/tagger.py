"""Structural tagging for PASK: the role of every generated token, from the output's structure.

PASK (parser-aware structural KV persistence, design section 4.1) tags each generated token with
its structural role and maps the tag to a small fixed set of buckets. The tagger is an incremental
lexer over the text the grammar matcher accepted: the Qwen3 tool-call format
(``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, free text around it) or a bare
JSON document (``response_format``), with the JSON Schema node at the current path giving each
key's and value's responsibility (required, optional, enum-constrained).

A token spanning several characters takes the most critical role among them (function name >
enum value > argument key > value > markup > punctuation > whitespace > free text). Proximity: a
token within ``near_k`` tokens after a required key, an enum value or the function name is tagged
near-critical (only the past is known when a token is generated).
"""

from __future__ import annotations

import copy
import enum
import operator
import re
from dataclasses import dataclass


class Role(enum.IntEnum):
    """Token class, in increasing order of criticality."""
    FREE_TEXT = 0
    WHITESPACE = 1
    PUNCTUATION = 2        # JSON scaffold: { } [ ] , : and quotes
    CALL_BOUNDARY = 3      # <tool_call>, </tool_call>
    FIELD_KEY = 4          # the "name" / "arguments" keys of a call
    VALUE = 5              # an argument (or JSON) value: string, number, literal
    ARG_KEY = 6            # an argument (or JSON property) key
    ENUM_VALUE = 7         # a value constrained by an enum
    FUNCTION_NAME = 8


class Responsibility(enum.IntEnum):
    NONE = 0
    OPTIONAL = 1
    REQUIRED = 2


@dataclass(frozen=True)
class Tag:
    role: Role
    responsibility: Responsibility = Responsibility.NONE
    value_type: str = ""          # "string", "number", "literal" for values
    near_critical: bool = False


BUCKETS = ("free_text", "whitespace", "punctuation", "punctuation_near_critical", "call_boundary",
           "field_key", "function_name", "arg_key_required", "arg_key_optional", "enum_value",
           "string_required", "string_optional", "number_required", "number_optional", "literal",
           "value_near_critical")
NUM_BUCKETS = len(BUCKETS)
_INDEX = {name: i for i, name in enumerate(BUCKETS)}


def bucket_of(tag: Tag) -> int:
    """The bucket id (index into :data:`BUCKETS`) of a tag."""
    r = tag.role
    if r in (Role.FREE_TEXT, Role.WHITESPACE, Role.CALL_BOUNDARY, Role.FIELD_KEY, Role.FUNCTION_NAME):
        return _INDEX[r.name.lower()]
    if r == Role.PUNCTUATION:
        return _INDEX["punctuation_near_critical" if tag.near_critical else "punctuation"]
    if r == Role.ENUM_VALUE:
        return _INDEX["enum_value"]
    if r == Role.ARG_KEY:
        return _INDEX["arg_key_required" if tag.responsibility == Responsibility.REQUIRED else "arg_key_optional"]
    if tag.value_type == "literal":
        return _INDEX["literal"]
    if tag.near_critical:
        return _INDEX["value_near_critical"]
    req = "required" if tag.responsibility == Responsibility.REQUIRED else "optional"
    return _INDEX[("number_" if tag.value_type == "number" else "string_") + req]


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_SPACE = re.compile(r"\s")           # str.isspace, one character (the same set of code points)


class _HasSpace(dict):
    """Token text -> whether it holds a whitespace character, searched once per distinct text
    (a vocabulary's worth at most): read for every generated token in free text."""

    def __missing__(self, text: str) -> bool:
        has = self[text] = _SPACE.search(text) is not None
        return has


_HAS_SPACE = _HasSpace()
_ROLE_AND_RESPONSIBILITY = operator.itemgetter(0, 1)   # max() key over (role, responsibility, value type)


@dataclass
class _Frame:
    kind: str                  # "object" | "array"
    schema: dict
    expect: str = "key"        # object: "key" | "colon" | "value" | "comma"; array: "value" | "comma"
    key: str | None = None


class StructuralTagger:
    """Incremental tagger for one request's output.

    Args:
        tools: OpenAI tool entries (tool-call output), or None.
        json_schema: the schema of a bare JSON output (``response_format``), or None.
        near_k: tokens after a critical token that count as near-critical.
    """

    def __init__(self, tools: list[dict] | None = None, json_schema: dict | None = None, near_k: int = 2):
        self.tools = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or []}
        self.near_k = near_k
        self._since_critical = near_k + 1
        self._pending = ""  # the part of a <tool_call> / </tool_call> marker seen so far
        self._mode = "json" if json_schema is not None and not tools else "text"
        self._root_schema = json_schema or {}
        self._reset_json(self._root_schema, call=False)

    def _reset_json(self, schema: dict, call: bool) -> None:
        self._stack: list[_Frame] = []
        self._in_string = False
        self._escape = False
        self._string_is_key = False
        self._string_text = ""
        self._string_role: tuple = (Role.VALUE, Responsibility.NONE, "string")
        self._scalar = ""          # a number / literal being read
        self._call = call          # the top object is a call {"name", "arguments"}
        self._top_schema = schema
        self._function: str | None = None

    # ------------------------------------------------------------------ schema lookups
    def _value_schema(self, frame: _Frame | None) -> dict:
        if frame is None:
            return self._top_schema
        if frame.kind == "array":
            return frame.schema.get("items") or {}
        if self._call and frame is self._stack[0]:
            return {}
        return (frame.schema.get("properties") or {}).get(frame.key, {})

    def _key_responsibility(self, frame: _Frame, key: str) -> Responsibility:
        if self._call and frame is self._stack[0]:
            return Responsibility.REQUIRED
        return Responsibility.REQUIRED if key in frame.schema.get("required", []) else Responsibility.OPTIONAL

    def _value_role(self, frame: _Frame | None, value_type: str) -> tuple:
        if self._call and frame is not None and frame is self._stack[0] and frame.key == "name":
            return Role.FUNCTION_NAME, Responsibility.REQUIRED, "string"
        schema = self._value_schema(frame)
        resp = Responsibility.NONE
        if frame is not None and frame.kind == "object" and frame.key is not None:
            resp = self._key_responsibility(frame, frame.key)
        if "enum" in schema or "const" in schema:
            return Role.ENUM_VALUE, resp, value_type
        return Role.VALUE, resp, value_type

    # ------------------------------------------------------------------ the lexer
    def _key_role(self, frame: _Frame) -> tuple:
        if self._call and frame is self._stack[0]:
            return Role.FIELD_KEY, Responsibility.NONE, "key"
        # Inside a key only its prefix is known: required if it can still become a required key.
        partial = self._string_text
        required = any(r.startswith(partial) for r in frame.schema.get("required", []))
        return Role.ARG_KEY, Responsibility.REQUIRED if required else Responsibility.OPTIONAL, "key"

    def _char(self, c: str) -> tuple:
        """Consume one character of JSON; return its (role, responsibility, value_type)."""
        frame = self._stack[-1] if self._stack else None
        if self._in_string:
            if self._escape or c != '"':
                self._escape = not self._escape and c == "\\"
                self._string_text += c
                return self._key_role(frame) if self._string_is_key else self._string_role
            self._in_string = False
            self._close_string(frame)
            return Role.PUNCTUATION, Responsibility.NONE, ""
        if self._scalar and not (c.isalnum() or c in "+-.eE"):
            self._scalar = ""
            if frame is not None:
                frame.expect = "comma"
        if c.isspace():
            return Role.WHITESPACE, Responsibility.NONE, ""
        if c == '"':
            self._in_string, self._string_text = True, ""
            self._string_is_key = frame is not None and frame.kind == "object" and frame.expect == "key"
            if not self._string_is_key:
                self._string_role = self._value_role(frame, "string")
            return Role.PUNCTUATION, Responsibility.NONE, ""
        if c in "{[":
            schema = self._value_schema(frame)
            if frame is not None and self._call and frame is self._stack[0] and frame.key == "arguments":
                schema = self.tools.get(self._function or "", {})
            self._stack.append(_Frame("object" if c == "{" else "array", schema,
                                      "key" if c == "{" else "value"))
            return Role.PUNCTUATION, Responsibility.NONE, ""
        if c in "}]":
            if self._stack:
                self._stack.pop()
            if self._stack:
                self._stack[-1].expect = "comma"
            elif self._mode == "call":
                self._mode = "call_end"
            return Role.PUNCTUATION, Responsibility.NONE, ""
        if c == ":":
            if frame is not None:
                frame.expect = "value"
            return Role.PUNCTUATION, Responsibility.NONE, ""
        if c == ",":
            if frame is not None:
                frame.expect = "key" if frame.kind == "object" else "value"
            return Role.PUNCTUATION, Responsibility.NONE, ""
        self._scalar += c  # a number or a literal (true / false / null)
        return self._value_role(frame, "number" if (c.isdigit() or c in "-+.") else "literal")

    def _close_string(self, frame: _Frame | None) -> None:
        if frame is None:
            return
        if self._string_is_key:
            frame.key, frame.expect = self._string_text, "colon"
            return
        if self._string_role[0] == Role.FUNCTION_NAME:
            self._function = self._string_text
        frame.expect = "comma"

    def _consume(self, text: str) -> list[tuple]:
        roles = []
        for c in text:
            if self._mode in ("text", "call_end"):
                # Markers may arrive over several tokens: match them character by character.
                marker = _OPEN if self._mode == "text" else _CLOSE
                candidate = self._pending + c
                if marker.startswith(candidate):
                    roles.append((Role.CALL_BOUNDARY, Responsibility.NONE, ""))
                    self._pending = candidate
                    if candidate == marker:
                        self._pending = ""
                        if self._mode == "text":
                            self._mode = "call"
                            self._reset_json({}, call=True)
                        else:
                            self._mode = "text"
                    continue
                self._pending = ""
                free = Role.FREE_TEXT if self._mode == "text" and not c.isspace() else Role.WHITESPACE
                roles.append((free, Responsibility.NONE, ""))
            else:
                roles.append(self._char(c))
        return roles

    def copy(self) -> "StructuralTagger":
        """An independent tagger in the same state (the frames copied, the schemas shared: they
        are read, never written), to tag tokens that may be taken back (jump-forward drafts)."""
        other = copy.copy(self)
        other._stack = [copy.copy(f) for f in self._stack]
        return other

    # Whole tokens in one step in the two common states (off: every token character by character).
    _whole_tokens = True

    def _tag(self, token_text: str) -> tuple:
        """(role, responsibility, value type, near-critical) of the next generated token.

        A whole token is tagged in one step (no per-character pass) in the two common states:
        free text or text after a call with no ``<`` that could start a marker; a run inside a
        JSON string with no quote or backslash. That equals the per-character maximum: a key's
        responsibility only falls as its text grows (a prefix of fewer required names), so its
        first character's is the highest. (Inline, not a method: one call per token less on the
        engine's per-sequence hot path.)"""
        fast = None
        if self._whole_tokens and not self._pending and token_text:
            if self._mode in ("text", "call_end"):
                if "<" not in token_text:
                    free = self._mode == "text" and not _HAS_SPACE[token_text]
                    fast = Role.FREE_TEXT if free else Role.WHITESPACE, Responsibility.NONE, ""
            elif self._in_string and not self._escape and '"' not in token_text and "\\" not in token_text:
                if not self._string_is_key:   # (mode json or call)
                    self._string_text += token_text
                    fast = self._string_role
                else:
                    self._string_text += token_text[0]
                    fast = self._key_role(self._stack[-1] if self._stack else None)
                    self._string_text += token_text[1:]
        if fast is not None:
            role, resp, value_type = fast
        else:
            roles = self._consume(token_text) or [(Role.WHITESPACE, Responsibility.NONE, "")]
            role, resp, value_type = max(roles, key=_ROLE_AND_RESPONSIBILITY)   # the first of the highest
        critical = role in (Role.FUNCTION_NAME, Role.ENUM_VALUE) or (
            role == Role.ARG_KEY and resp == Responsibility.REQUIRED)
        near = not critical and self._since_critical <= self.near_k
        self._since_critical = 0 if critical else self._since_critical + 1
        return role, resp, value_type if value_type in _VALUE_TYPES else "", near

    def feed(self, token_text: str) -> Tag:
        """Tag the next generated token from its decoded text."""
        return Tag(*self._tag(token_text))

    def feed_bucket(self, token_text: str) -> int:
        """``bucket_of(self.feed(token_text))`` without building the Tag (the engine's hot path)."""
        return _BUCKET_OF[self._tag(token_text)]


_VALUE_TYPES = ("string", "number", "literal")
_BUCKET_OF = {(r, s, t, n): bucket_of(Tag(r, s, t, n)) for r in Role for s in Responsibility
              for t in ("",) + _VALUE_TYPES for n in (False, True)}
