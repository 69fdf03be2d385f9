"""``uniqueItems`` over arrays of free strings, enforced while decoding.

No grammar can say "these strings are distinct" for an unbounded set of strings, so llguidance
refuses ``uniqueItems`` (``replicas/schema_collections.py`` writes it out only over a small
finite set of items). Where every array that must be unique holds *free* strings (``items`` is
``{type: string}`` with at most a ``minLength``: no ``maxLength``, ``pattern``, ``format`` or
``enum``) at places of the instance known from the schema, the keyword is removed from the
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
  draws it. A free string can always go on with another character instead, so masking never
  leaves a sequence without a way forward (should a mask still end empty, only EOS stays).
"""

from __future__ import annotations

import json
from typing import Any

import torch

ITEM, ANY_KEY = 0, 1      # path segments besides object keys (str)
MAX_VISITS = 20_000       # schema nodes walked (a DAG of anyOf may multiply paths)
_FREE = {"type", "minLength", "title", "description", "examples", "default", "$comment", "markdownDescription",
         "$id", "deprecated", "readOnly", "writeOnly"}


class _Unsupported(Exception):
    pass


def _free_strings(node: dict, root: Any) -> bool:
    from replicas.schema_oneof import UnresolvedRef, resolve_pointer
    items = node.get("items")
    seen = 0
    while isinstance(items, dict) and isinstance(items.get("$ref"), str) and set(items) <= _FREE | {"$ref"}:
        try:
            items = resolve_pointer(root, items["$ref"])
        except UnresolvedRef:
            return False
        seen += 1
        if seen > 32:
            return False
    return (isinstance(items, dict) and items.get("type") == "string" and set(items) <= _FREE
            and not any(k in node for k in ("prefixItems", "additionalItems", "contains")))


def unique_string_paths(root: Any) -> frozenset | None:
    """The instance paths of ``root``'s arrays with ``uniqueItems: true`` (module doc), or None
    where one of them is not an array of free strings at a place this can name. An empty set:
    no such array."""
    from replicas.schema_oneof import UnresolvedRef, resolve_pointer
    out: set = set()
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
            if not _free_strings(node, root):
                raise _Unsupported
            out.add(path)
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
    return frozenset(out)


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
                    self.stack.append({"kind": "arr", "path": path, "seen": frozenset(),
                                       "unique": any(_matches(p, path) for p in self.paths)})
            elif c in (0x7D, 0x5D):   # } ]
                if self.stack:
                    self.stack.pop()
            elif c == 0x2C and self.stack and self.stack[-1]["kind"] == "obj":   # ,
                self.stack[-1]["expect"] = "key"
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

    def _repeats(self, data: bytes) -> bool:
        return not self._scan.copy().feed(data)

    def accept_token(self, token: int) -> bool:
        if token in self._stop:
            ok = self.inner.accept_token(token)
            if ok:
                self._lens.append(0)
            return ok
        data = self._bytes[token]
        if self._repeats(data) or not self.inner.accept_token(token):
            return False
        self._scan.feed(data)
        self._text += data
        self._lens.append(len(data))
        return True

    def accept_string(self, text: str) -> bool:
        data = text.encode()
        if self._repeats(data):
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
        for i, ch in enumerate(s):   # cut before a character that would close a repeated item
            if not scan.feed(ch.encode()):
                return s[:i]
        return s

    @torch.inference_mode()   # (the engine's bitmask buffer may be an inference tensor)
    def restrict(self, row: torch.Tensor) -> None:
        """Clear, in ``row`` (this matcher's int32 bitmask words), the tokens that would close a
        repeated item of a unique array; if nothing is left, allow only the stop tokens."""
        top = self._scan.stack[-1] if self._scan.stack else None
        ids = self._quotes if top is not None and top["kind"] == "arr" and top["unique"] else self._open_quotes
        allowed = ids[((row[ids // 32] >> (ids % 32)) & 1).bool()].tolist()
        cleared = False
        for t in allowed:
            if self._repeats(self._bytes[t]):
                word, bit = divmod(t, 32)
                w = (int(row[word]) & 0xFFFFFFFF) & ~(1 << bit)
                row[word] = w - (1 << 32) if w >= 1 << 31 else w
                cleared = True
        if cleared and not bool(row.any()):
            for t in self._stop:
                word, bit = divmod(t, 32)
                w = (int(row[word]) & 0xFFFFFFFF) | (1 << bit)
                row[word] = w - (1 << 32) if w >= 1 << 31 else w
