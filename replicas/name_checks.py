"""Property names checked on the text while decoding: one spelling per name, no name twice.

Both backends let an object take a name it does not declare as any JSON string, so a declared
name can be written another way and pass for an undeclared one: ``{"\\u0061": "x"}`` is
``{"a": "x"}`` once decoded, and its value was checked against ``additionalProperties`` (or
nothing) instead of ``a``'s schema; and a name written twice in one object counts once once
decoded (``json.loads`` keeps the last value), while xgrammar counts ``minProperties`` on the
text. Both were found at stop 42 by probing texts a model could write (the soundness bench's
generated instances did not spell a name with an escape; they do now: ``escaped_names``).

:class:`NameCheckedMatcher` wraps a ``json_schema`` grammar's matcher (a ``tools`` one: inside each
``<tool_call>`` block's JSON) and refuses, while decoding, a token that would write a second
spelling of a character inside a property name, or close a name already written in the same
object (``accept_token`` refuses it; :meth:`NameCheckedMatcher.restrict` masks it out of the
step's bitmask, so sampling never draws it). Every name then has one spelling, as
``json.dumps(..., ensure_ascii=False)`` writes it but for DEL: its characters as they are, with ``\\"``,
``\\\\``, the short escapes ``\\b \\f \\n \\r \\t``, ``\\u00XX`` (lowercase) for the other control
characters and ``\\u007f`` for DEL; so a declared name is the one the grammar declares, and the
object holds distinct names. The cost: a non-ASCII character written ``\\uXXXX`` in a name is
refused (the character itself is taken). A name repeated is refused at its closing quote; where
the grammar allows any name the model writes another one (should a mask still end empty, only
EOS stays, as in ``replicas/decode_checks.py``).
"""

from __future__ import annotations

import numpy as np
import torch

from replicas.decode_checks import TextCheckedMatcher

_QUOTE, _BACKSLASH = 0x22, 0x5C


class _Names:
    """JSON text scanned byte by byte: for each open object the names written so far (raw bytes)
    and whether a name comes next (after ``{`` and ``,``); whether the open string is a name.
    :meth:`feed` returns False (and stops: feed a :meth:`copy`) at a byte that writes a second
    spelling in a name (``\\/``, a ``\\u`` escape but those of the module doc, a raw DEL) or closes a
    name already written in its object. The text is the
    grammar's, so well-formed JSON is assumed."""

    __slots__ = ("stack", "in_str", "esc", "key", "raw", "end", "hexd")

    def __init__(self):
        self.stack: list = []      # per open container: [names, a name comes next] (object) or None (array)
        self.in_str = self.esc = self.key = False
        self.raw = b""             # the open name's bytes so far
        self.end = -1              # with ``until_end``: where in the last data the outer value ended
        self.hexd = None           # in a name's \u escape: its hex digits so far

    def copy(self) -> "_Names":
        c = _Names.__new__(_Names)
        c.stack = [None if f is None else [set(f[0]), f[1]] for f in self.stack]
        c.in_str, c.esc, c.key, c.raw, c.end, c.hexd = self.in_str, self.esc, self.key, self.raw, self.end, self.hexd
        return c

    @classmethod
    def in_name(cls, esc: bool = False, hexd: str | None = None) -> "_Names":
        """A scan inside an object's first name, at the given escape state (for the tables)."""
        c = cls()
        c.stack, c.in_str, c.key, c.esc, c.hexd = [[set(), False]], True, True, esc, hexd
        return c

    def active(self) -> "_Names":
        return self

    def feed(self, data: bytes, until_end: bool = False) -> bool:
        """Scan ``data``; False at a refused byte. ``until_end``: stop after the byte that closes
        the outermost object or array (its index in ``end``)."""
        stack = self.stack
        for i, c in enumerate(data):
            if self.in_str:
                if self.hexd is not None:   # a name's \u00XX: a control character without a short escape, or DEL
                    d, n = chr(c), len(self.hexd)
                    if not (d in "0123456789abcdef" and (n > 1 or d == "0") and (n != 2 or d in "017")
                            and (n != 3 or self.hexd[2] == "1" or self.hexd[2] == "0" and d not in "89acd"
                                 or self.hexd[2] == "7" and d == "f")):
                        return False
                    self.hexd += d
                    if n == 3:
                        self.raw += b"\\u" + self.hexd.encode()
                        self.hexd = None
                elif self.esc:
                    self.esc = False
                    if self.key:
                        if c == 0x2F:   # \/: a second spelling of /
                            return False
                        if c == 0x75:
                            self.hexd = ""
                        else:
                            self.raw += bytes((c,))
                elif c == _BACKSLASH:
                    self.esc = True
                    if self.key:
                        self.raw += b"\\"
                elif c == _QUOTE:
                    self.in_str = False
                    if self.key:
                        top = stack[-1]
                        if self.raw in top[0]:
                            return False
                        top[0].add(self.raw)
                        top[1] = self.key = False
                elif self.key:
                    if c == 0x7F:   # DEL: written \u007f (llguidance takes no other spelling)
                        return False
                    self.raw += bytes((c,))
            elif c == _QUOTE:
                self.in_str, self.raw = True, b""
                self.key = bool(stack) and stack[-1] is not None and stack[-1][1]
            elif c == 0x7B:   # {
                stack.append([set(), True])
            elif c == 0x5B:   # [
                stack.append(None)
            elif c == 0x7D or c == 0x5D:   # } ]
                if stack:
                    stack.pop()
                    if until_end and not stack:
                        self.end = i
                        return True
            elif c == 0x2C:   # ,
                if stack and stack[-1] is not None:
                    stack[-1][1] = True
        return True


class _ToolCallNames:
    """The same check on a tools grammar's text, inside each ``<tool_call>`` block's JSON only
    (the text around the calls is free): a :class:`_Names` from the tag to the end of the call's
    object."""

    TAG = b"<tool_call>"
    __slots__ = ("names", "tail")

    def __init__(self):
        self.names: _Names | None = None   # inside a call's JSON
        self.tail = b""                    # the last bytes of free text (a tag split over tokens)

    def copy(self) -> "_ToolCallNames":
        c = _ToolCallNames.__new__(_ToolCallNames)
        c.names, c.tail = (self.names.copy() if self.names is not None else None), self.tail
        return c

    def active(self) -> "_Names | None":
        return self.names

    @property
    def esc(self) -> bool:
        return self.names is not None and self.names.esc

    def feed(self, data: bytes) -> bool:
        while data:
            if self.names is None:
                text = self.tail + data
                i = text.find(self.TAG)
                if i < 0:
                    self.tail = text[-(len(self.TAG) - 1):]
                    return True
                data, self.tail, self.names = text[i + len(self.TAG):], b"", _Names()
                continue
            if not self.names.feed(data, until_end=True):
                return False
            if self.names.end < 0:
                return True
            data, self.names = data[self.names.end + 1:], None
        return True


def _opens_and_more(data: bytes) -> bool:
    """Whether ``data`` has a quote followed by a quote, a backslash or a DEL."""
    i = data.find(b'"')
    return i >= 0 and any(c in data[i + 1:] for c in (b'"', b"\\", b"\x7f"))


class NameTables:
    """Per vocabulary, built once: the tokens that can make :class:`_Names` refuse, by where the
    text is. ``token_bytes[t]``: token ``t``'s bytes."""

    def __init__(self, token_bytes: list):
        self.token_bytes = token_bytes
        ids = lambda pred: np.array([t for t, b in enumerate(token_bytes) if pred(b)], dtype=np.int64)
        # in a name: the tokens refused there whatever names came before (an escape other than
        # \\u00XX for a control character without a short one, lowercase); by escape state, lazily
        # (only the clean state is common); those that close it and come back into another name
        # (",", then a quote)
        self._refused = {(False, None): ids(lambda b: (b"\\" in b or b"\x7f" in b) and not _Names.in_name().feed(b))}
        self.name_reenter = ids(lambda b: b'"' in b and b"," in b[b.index(b'"'):] and b'"' in b[b.index(b'"') + 1:])
        self.backslash_or_quote = ids(lambda b: b"\\" in b or b'"' in b)
        # elsewhere: the tokens that can open a name and, in the same token, write an escape, a DEL
        # or close it (a quote, then a quote, a backslash or a DEL)
        self.opens_and_more = ids(_opens_and_more)
        # in a value string: those that close it, open a name and then do the same
        self.closes_opens_and_more = ids(lambda b: b'"' in b and _opens_and_more(b[b.index(b'"') + 1:]))
        # outside a tool call's JSON: those that may end its tag, then open a name
        self.tag = ids(lambda b: b">" in b and b'"' in b[b.index(b">"):])
        # in a name: the tokens that close it with these bytes before their quote (no backslash)
        self.closing: dict[bytes, list[int]] = {}
        for t, b in enumerate(token_bytes):
            if b'"' in b and b"\\" not in b[:b.index(b'"')]:
                self.closing.setdefault(b[:b.index(b'"')], []).append(t)


def _refused_in_name(tables: "NameTables", esc: bool, hexd: str | None) -> np.ndarray:
    key = (esc, hexd)
    if key not in tables._refused:
        tables._refused[key] = np.array([t for t, b in enumerate(tables.token_bytes)
                                         if not _Names.in_name(esc, hexd).feed(b)], dtype=np.int64)
    return tables._refused[key]


def _allowed(words: np.ndarray, ids: np.ndarray) -> list[int]:
    """The tokens of ``ids`` set in bitmask row ``words`` (int32)."""
    if not ids.size:
        return []
    return ids[(words[ids >> 5] >> (ids & 31)) & 1 == 1].tolist()


def _clear(words: np.ndarray, tokens) -> None:
    """Clear the bits of ``tokens`` in bitmask row ``words`` (int32, in place)."""
    ids = np.asarray(tokens, dtype=np.int64)
    ids = ids[(ids >> 5) < words.shape[0]]
    np.bitwise_and.at(words, ids >> 5, (~(np.int64(1) << (ids & 31))).astype(np.int32))


class NameCheckedMatcher(TextCheckedMatcher):
    """A :class:`replicas.grammar.Matcher` (``inner``, any backend, possibly a
    ``decode_checks.CheckedMatcher``) with the module's check on property names; ``tool_calls``:
    only inside each ``<tool_call>`` block's JSON."""

    def __init__(self, inner, tables: NameTables, stop_ids: list, tool_calls: bool = False):
        super().__init__(inner, tables.token_bytes, stop_ids, _ToolCallNames if tool_calls else _Names)
        self._tables = tables

    def _blocked(self, data: bytes) -> bool:
        if not (self._scan.esc or b'"' in data or b"\\" in data or b"\x7f" in data
                or getattr(self._scan.active(), "hexd", None) is not None):
            return False   # (no byte of it can write an escape or close a name)
        return self._refuses(self._scan.copy(), data)

    def accept_string(self, text: str) -> bool:
        data = text.encode()
        if self._blocked(data) or not self.inner.accept_string(text):
            return False
        # one entry per step the inner matcher's rollback counts: llguidance's tokens, or the
        # whole string for xgrammar (which takes it as one step)
        inner = self.inner
        while not hasattr(inner, "_tok") and hasattr(inner, "inner"):
            inner = inner.inner
        self._took(data, [len(self._bytes[t]) for t in inner._tok.tokenize_str(text)] if hasattr(inner, "_tok")
                   else [len(data)])
        return True

    def restrict(self, row: torch.Tensor) -> None:
        """Clear, in ``row`` (this matcher's int32 bitmask words, filled by the grammar), the tokens
        the check refuses; if nothing is left, allow only the stop tokens. In a name: the tokens
        refused there whatever came before (a table per escape state), those closing it into a
        name already written (a table lookup per such name), and, scanned, those that close it
        and open another; elsewhere, scanned, the tokens that open a name and write a backslash,
        a DEL or a quote in it (outside a tool call's JSON: those ending its tag)."""
        if hasattr(self.inner, "restrict"):
            self.inner.restrict(row)
        scan, tables = self._scan.active(), self._tables
        words = row.numpy()   # (a view: the bitmask buffer is on the CPU, xgrammar's allocation)
        blocked: list[int] = []
        if scan is None:   # (tool calls: outside a call's JSON, only a token ending a tag can lead into one)
            candidates = _allowed(words, tables.tag)
        elif scan.in_str and scan.key:
            names = scan.stack[-1][0]
            blocked += _refused_in_name(tables, scan.esc, scan.hexd).tolist()
            if scan.esc or scan.hexd is not None:   # (rare: inside an escape in a name)
                candidates = _allowed(words, tables.backslash_or_quote) if names else []
            else:
                for name in names:
                    if name.startswith(scan.raw):
                        blocked += tables.closing.get(name[len(scan.raw):], [])
                candidates = _allowed(words, tables.name_reenter)
        else:
            candidates = _allowed(words, tables.closes_opens_and_more if scan.in_str else tables.opens_and_more)
        blocked += [t for t in candidates if self._blocked(self._bytes[t])]
        if not blocked:
            return
        _clear(words, blocked)
        if not words.any():
            self._only_stop(row)
