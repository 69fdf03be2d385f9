"""``uniqueItems`` over arrays of strings, enforced while decoding.

No grammar can say "these strings are distinct" for an unbounded set of strings, so llguidance
refuses ``uniqueItems`` (``replicas/schema_collections.py`` writes it out only over a small
finite set of items: at most 128 arrays). Where every array that must be unique holds *free*
strings (``items`` is ``{type: string}`` with at most a ``minLength``: no ``maxLength``,
``pattern`` or ``format``) or strings of an ``enum`` / ``const`` of plain ASCII values (one way
to write each) at places of the instance known from the schema, the keyword is removed from the
grammar and checked on the text instead, exactly:

- :func:`unique_string_paths` finds those places: instance paths (object keys, ``ITEM`` for an
  array's items, ``ANY_KEY`` under ``additionalProperties`` / ``patternProperties``) through
  ``properties``, ``items``, local ``$ref``, ``allOf``, and also ``anyOf`` / ``oneOf`` /
  ``then`` / ``else`` branches (there uniqueness may be enforced where the branch that asks
  for it does not apply: only ever stricter, never looser). A cycle, a ``$ref`` that is not a
  local pointer, a unique array of anything else: None (the schema stays refused).
- :class:`UniqueStringsMatcher` wraps the grammar's matcher and scans the accepted bytes as JSON
  (a stack of objects and arrays with their paths). A token that would close an element of a
  unique array equal to an earlier one (compared as decoded strings) is refused by
  ``accept_token`` and masked out of the step's bitmask (:meth:`restrict`), so sampling never
  draws it. A free string can always go on with another character instead. For an enum the
  check looks ahead: a token is also refused where the open item would start no value left
  unused, or where a comma would ask for an item when every value is used. So masking never
  leaves a sequence without a way forward (should a mask still end empty, as for an array whose
  ``minItems`` exceeds its values, which no instance meets, only EOS stays).
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import torch

ITEM, ANY_KEY = 0, 1      # path segments besides object keys (str)
MAX_VISITS = 20_000       # schema nodes walked (a DAG of anyOf may multiply paths)
_FREE = {"type", "minLength", "title", "description", "examples", "default", "$comment", "markdownDescription",
         "$id", "deprecated", "readOnly", "writeOnly"}


class _Unsupported(Exception):
    pass


def _plain(v: Any) -> bool:
    """A string JSON writes one way only: printable ASCII, no quote, no backslash."""
    return isinstance(v, str) and all(" " <= ch <= "~" and ch not in '"\\' for ch in v)


def _item_values(node: dict, root: Any):
    """What a unique array ``node`` may hold, for the check: None for free strings, the frozenset
    of values for an ``enum`` / ``const`` of plain strings. Raises :class:`_Unsupported` otherwise."""
    from replicas.schema_oneof import UnresolvedRef, resolve_pointer
    if any(k in node for k in ("prefixItems", "additionalItems", "contains")):
        raise _Unsupported
    items = node.get("items")
    for _ in range(32):
        if not (isinstance(items, dict) and isinstance(items.get("$ref"), str) and set(items) <= _FREE | {"$ref"}):
            break
        try:
            items = resolve_pointer(root, items["$ref"])
        except UnresolvedRef:
            raise _Unsupported from None
    if not isinstance(items, dict):
        raise _Unsupported
    if items.get("type") == "string" and set(items) <= _FREE:
        return None
    values = items["enum"] if isinstance(items.get("enum"), list) else [items["const"]] if "const" in items else None
    if (values and all(_plain(v) for v in values) and items.get("type", "string") == "string"
            and set(items) <= _FREE | {"enum", "const"}):
        return frozenset(values)
    raise _Unsupported


def unique_string_paths(root: Any) -> frozenset | None:
    """``(instance path, values)`` for ``root``'s arrays with ``uniqueItems: true`` (module doc;
    values: None for free strings, else the enum's frozenset), or None where one of them holds
    other items, is at a place this cannot name, or one place may be asked two kinds of items.
    An empty set: no such array."""
    from replicas.schema_oneof import UnresolvedRef, resolve_pointer
    out: dict = {}
    visits = 0

    def walk(node: Any, path: tuple, stack: frozenset) -> None:
        nonlocal visits
        if not isinstance(node, dict):
            return
        visits += 1
        if id(node) in stack or visits > MAX_VISITS:
            raise _Unsupported
        stack = stack | {id(node)}
        if "$ref" in node:
            if not isinstance(node["$ref"], str):
                raise _Unsupported
            try:
                walk(resolve_pointer(root, node["$ref"]), path, stack)
            except UnresolvedRef:
                raise _Unsupported from None
        if node.get("uniqueItems") is True:
            values = _item_values(node, root)
            if out.setdefault(path, values) != values:
                raise _Unsupported   # two kinds of items asked at one place
        for k, sub in (node.get("properties") or {}).items() if isinstance(node.get("properties"), dict) else ():
            walk(sub, path + (k,), stack)
        for sub in (node.get("patternProperties") or {}).values() if isinstance(node.get("patternProperties"), dict) else ():
            walk(sub, path + (ANY_KEY,), stack)
        walk(node.get("additionalProperties"), path + (ANY_KEY,), stack)
        items = node.get("items")
        for sub in (items if isinstance(items, list) else [items]) + list(node.get("prefixItems") or []) + [node.get("additionalItems")]:
            walk(sub, path + (ITEM,), stack)
        for k in ("allOf", "anyOf", "oneOf"):
            for sub in node.get(k) or [] if isinstance(node.get(k), list) else ():
                walk(sub, path, stack)
        for k in ("then", "else", "if", "not"):
            walk(node.get(k), path, stack)
        for k in ("dependentSchemas", "dependencies"):
            if isinstance(node.get(k), dict):
                for sub in node[k].values():
                    walk(sub, path, stack)

    try:
        walk(root, (), frozenset())
    except (_Unsupported, RecursionError):
        return None
    for (a, va), (b, vb) in itertools.combinations(out.items(), 2):
        if va != vb and _overlap(a, b):
            return None   # one array could be asked for two kinds of items
    return frozenset(out.items())


def remove_unique_items(root: Any) -> frozenset | None:
    """Remove ``uniqueItems: true`` from ``root`` (in place) where :func:`unique_string_paths`
    names every such array, and return those paths (None, ``root`` unchanged, where it does not)."""
    from replicas.grammar import _walk
    paths = unique_string_paths(root)
    if not paths:
        return paths
    for node, _ in _walk(root):
        if node.get("uniqueItems") is True:
            del node["uniqueItems"]
    return paths


def _overlap(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x == y or (ANY_KEY in (x, y) and ITEM not in (x, y)) for x, y in zip(a, b))


def _matches(pattern: tuple, path: tuple) -> bool:
    return len(pattern) == len(path) and all(
        p == s or (p == ANY_KEY and isinstance(s, str)) for p, s in zip(pattern, path))


class _Scan:
    """JSON text scanned byte by byte: the open objects / arrays with their instance paths, and
    for each array that must be unique the strings its items decoded to so far.
    :meth:`feed` returns False (and stops) at a byte that closes a repeated item."""

    def __init__(self, paths: frozenset):
        self.paths = paths
        self.stack: list[dict] = []
        self.in_str = self.esc = False
        self.raw = b""
        self.role = None   # "key" / "value" of the open string
        self.dup_of = None  # the unique array frame the open string is an item of

    def copy(self) -> "_Scan":
        c = _Scan.__new__(_Scan)
        c.__dict__.update(self.__dict__)
        c.stack = [dict(f) for f in self.stack]   # (a frame's set is replaced, never changed in place)
        return c

    def _child_path(self) -> tuple:
        if not self.stack:
            return ()
        top = self.stack[-1]
        return top["path"] + ((top["key"],) if top["kind"] == "obj" else (ITEM,))

    def viable(self) -> bool:
        """Whether an array of an ``enum`` can still be finished: an open item is the start of a
        value not used yet, and an item after a comma has one left to be."""
        top = self.stack[-1] if self.stack else None
        if top is None or top["kind"] != "arr" or top.get("values") is None:
            return True
        left = top["values"] - top["seen"]
        if self.in_str:
            partial = b'"' + self.raw
            return any(json.dumps(v).encode().startswith(partial) for v in left)
        return top["expect"] != "item" or bool(left)

    def feed(self, data: bytes) -> bool:
        for c in data:
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == 0x5C:   # backslash
                    self.esc = True
                elif c == 0x22:   # the closing quote
                    self.in_str = False
                    try:
                        value = json.loads(b'"' + self.raw + b'"')
                    except ValueError:
                        value = None
                    top = self.stack[-1] if self.stack else None
                    if self.role == "key" and top is not None:
                        top["key"] = value
                    elif self.dup_of is not None and top is not None:
                        if value in top["seen"]:
                            return False
                        top["seen"] = top["seen"] | {value}
                    if top is not None and top["kind"] == "arr":
                        top["expect"] = "sep"
                    continue
                self.raw += bytes((c,))
                continue
            if c == 0x22:
                top = self.stack[-1] if self.stack else None
                self.in_str, self.raw = True, b""
                self.role = "key" if top is not None and top["kind"] == "obj" and top["expect"] == "key" else "value"
                self.dup_of = top if top is not None and top["kind"] == "arr" and top["unique"] else None
            elif c in (0x7B, 0x5B):   # { [
                path = self._child_path()
                if c == 0x7B:
                    self.stack.append({"kind": "obj", "path": path, "key": None, "expect": "key"})
                else:
                    hits = [v for p, v in self.paths if _matches(p, path)]
                    self.stack.append({"kind": "arr", "path": path, "seen": frozenset(), "unique": bool(hits),
                                       "values": hits[0] if hits else None, "expect": "first"})
            elif c in (0x7D, 0x5D):   # } ]
                if self.stack:
                    self.stack.pop()
                if self.stack and self.stack[-1]["kind"] == "arr":
                    self.stack[-1]["expect"] = "sep"
            elif c == 0x2C and self.stack:   # ,
                self.stack[-1]["expect"] = "key" if self.stack[-1]["kind"] == "obj" else "item"
            elif c == 0x3A and self.stack and self.stack[-1]["kind"] == "obj":   # :
                self.stack[-1]["expect"] = "value"
        return True


class UniqueStringsMatcher:
    """A :class:`replicas.grammar.Matcher` (``inner``) with the module's check of unique arrays
    at ``paths``. ``token_bytes[t]``: token ``t``'s bytes; ``quote_ids``: int64 ids of the
    tokens holding a ``"`` (the only ones that can close a string), ``open_quote_ids`` those also
    holding a ``[`` (the only ones that can open an array and close an item of it)."""

    def __init__(self, inner, paths: frozenset, token_bytes: list, quote_ids: torch.Tensor,
                 open_quote_ids: torch.Tensor, stop_ids: list):
        self.inner, self.backend, self.native = inner, inner.backend, inner.native
        self._bytes, self._quotes, self._open_quotes, self._stop = token_bytes, quote_ids, open_quote_ids, set(stop_ids)
        self._scan = _Scan(paths)
        self._text = b""
        self._lens: list[int] = []   # bytes of each accepted token

    @property
    def masked(self) -> bool:
        return self.inner.masked

    @masked.setter
    def masked(self, value: bool) -> None:
        self.inner.masked = value

    def _blocked(self, data: bytes) -> bool:
        """Whether ``data`` would close a repeated item, or leave an enum's array unfinishable."""
        scan = self._scan.copy()
        return not scan.feed(data) or not scan.viable()

    def accept_token(self, token: int) -> bool:
        if token in self._stop:
            ok = self.inner.accept_token(token)
            if ok:
                self._lens.append(0)
            return ok
        data = self._bytes[token]
        if self._blocked(data) or not self.inner.accept_token(token):
            return False
        self._scan.feed(data)
        self._text += data
        self._lens.append(len(data))
        return True

    def accept_string(self, text: str) -> bool:
        data = text.encode()
        if self._blocked(data):
            return False
        ids = self.inner._tok.tokenize_str(text)
        if not self.inner.accept_string(text):
            return False
        self._scan.feed(data)
        self._text += data
        self._lens += [len(self._bytes[t]) for t in ids]
        return True

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)
        if num_tokens:   # the scan is rebuilt from the bytes kept (rollbacks are rare and short)
            self._lens = self._lens[:max(len(self._lens) - num_tokens, 0)]
            self._text = self._text[:sum(self._lens)]
            self._scan = _Scan(self._scan.paths)
            self._scan.feed(self._text)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def find_jump_forward_string(self) -> str:
        s = self.inner.find_jump_forward_string()
        if not s:
            return s
        scan = self._scan.copy()
        for i, ch in enumerate(s):   # cut before a character the check would refuse
            if not scan.feed(ch.encode()) or not scan.viable():
                return s[:i]
        return s

    @torch.inference_mode()   # (the engine's bitmask buffer may be an inference tensor)
    def restrict(self, row: torch.Tensor) -> None:
        """Clear, in ``row`` (this matcher's int32 bitmask words), the tokens that would close a
        repeated item of a unique array; if nothing is left, allow only the stop tokens."""
        top = self._scan.stack[-1] if self._scan.stack else None
        if top is not None and top["kind"] == "arr" and top["values"] is not None:
            words = row.nonzero().flatten()   # an enum's array: every allowed token (few) is looked at
            bits = ((row[words].unsqueeze(1).long() & 0xFFFFFFFF) >> torch.arange(32)) & 1
            allowed = (words.unsqueeze(1) * 32 + torch.arange(32))[bits.bool()].tolist()
            allowed = [t for t in allowed if t < len(self._bytes) and t not in self._stop]
        else:
            ids = self._quotes if top is not None and top["kind"] == "arr" and top["unique"] else self._open_quotes
            allowed = ids[((row[ids // 32] >> (ids % 32)) & 1).bool()].tolist()
        cleared = False
        for t in allowed:
            if self._blocked(self._bytes[t]):
                word, bit = divmod(t, 32)
                w = (int(row[word]) & 0xFFFFFFFF) & ~(1 << bit)
                row[word] = w - (1 << 32) if w >= 1 << 31 else w
                cleared = True
        if cleared and not bool(row.any()):
            for t in self._stop:
                word, bit = divmod(t, 32)
                w = (int(row[word]) & 0xFFFFFFFF) | (1 << bit)
                row[word] = w - (1 << 32) if w >= 1 << 31 else w
