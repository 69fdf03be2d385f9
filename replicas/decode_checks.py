"""JSON Schema keywords no grammar writes, checked on the text while decoding: ``uniqueItems``,
and ``minProperties`` / ``maxProperties`` on objects open to names they do not list.

No grammar can say "these items are distinct" for an unbounded set of items, so llguidance
refuses ``uniqueItems`` (``replicas/schema_collections.py`` writes it out only over a small
finite set of items: at most 128 arrays); llguidance 1.9 counts properties only where every
name is listed and required ("min/maxProperties only supported when all keys listed in
"properties" are required"). Where every such array and object sits at a place of the instance
known from the schema and the check can never leave a sequence without a way forward, the
keywords are removed from the grammar and checked on the text instead, exactly:

- :func:`check_paths` finds those places: instance paths (object keys, ``ITEM`` for an
  array's items, ``ANY_KEY`` under ``additionalProperties`` / ``patternProperties``) through
  ``properties``, ``items``, local ``$ref``, ``allOf``, and also ``anyOf`` / ``oneOf`` /
  ``then`` / ``else`` branches (there a check may be enforced where the branch that asks
  for it does not apply: only ever stricter, never looser). A check under a recursion (a
  cycle of references), a ``$ref`` that is not a local pointer, a unique array of other items,
  two checks at one place: None (the schema stays refused).
- A unique array's items must be *extendable* (:func:`_extendable`, read on the schema
  llguidance compiles, so after ``strict`` closed its objects): every item the grammar can
  write can instead be continued, at the byte that would end it, into a different item: a
  string with no ``maxLength``, ``enum`` or ``format`` and a pattern
  :func:`replicas.regex_complement.extendable` (one more character); a number with no
  ``maximum`` or ``multipleOf`` and a ``minimum``, if any, at least 0 (one more digit: ``5`` ->
  ``50``); an object whose ``additionalProperties`` is not ``false``, without ``maxProperties``
  / ``propertyNames`` / ``dependencies`` (one more property with a new name); an array without
  ``maxItems`` (one more item); ``anyOf`` / ``oneOf`` of such members, ``allOf`` of them with at
  most one ``pattern``. ``true`` / ``false`` / ``null`` and the integer ``0`` cannot be
  continued: they are refused at their first byte where already used. Or the items are an
  ``enum`` / ``const`` of plain ASCII strings (one way to write each), checked with a look-ahead:
  a token is also refused where the open item would start no value left unused, or where a
  comma would ask for an item when every value is used.
- A counted object must be able to take one more property under a new name where it has a
  ``minProperties`` (:func:`_takes_new_name`), and have no ``required`` names where it has a
  ``maxProperties`` (so that ``}`` may always follow the last property allowed).
- :class:`CheckedMatcher` wraps the grammar's matcher and scans the accepted bytes as JSON
  (a stack of objects and arrays with their paths). A token is refused by ``accept_token`` and
  masked out of the step's bitmask (:meth:`CheckedMatcher.restrict`), so sampling never draws
  it, where it would end an item of a unique array equal to an earlier one (compared as
  ``jsonschema`` compares: ``1`` equals ``1.0``, ``true`` is not ``1``, key order aside), close
  an object with fewer distinct names than ``minProperties``, or write the comma before a
  property past ``maxProperties``; the item or object goes on instead. (Should a mask still end
  empty, as for an array whose ``minItems`` exceeds its enum's values, which no instance meets,
  only EOS stays.)
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import torch

ITEM, ANY_KEY = 0, 1      # path segments besides object keys (str)
MAX_VISITS = 20_000       # schema nodes walked (a DAG of anyOf may multiply paths)
_ANNOTATIONS = {"title", "description", "examples", "default", "$comment", "markdownDescription", "$id",
                "$schema", "deprecated", "readOnly", "writeOnly", "$defs", "definitions", "$anchor", "id"}
_FREE = _ANNOTATIONS | {"type", "minLength"}
# Keywords an extendable item may carry (module doc); any other (maxLength, enum, maximum,
# maxProperties, not, if, ...) leaves the array refused.
_EXTENDABLE = _ANNOTATIONS | {"type", "properties", "required", "additionalProperties", "patternProperties",
                              "items", "minItems", "minLength", "pattern", "minimum", "exclusiveMinimum",
                              "minProperties", "anyOf", "oneOf", "allOf", "$ref", "format"}
_EXTENDABLE_FORMATS = {"uri"}   # every URI goes on into another one (one more path character)


class _Unsupported(Exception):
    pass


def _plain(v: Any) -> bool:
    """A string JSON writes one way only: printable ASCII, no quote, no backslash."""
    return isinstance(v, str) and all(" " <= ch <= "~" and ch not in '"\\' for ch in v)


def _resolve(node: Any, root: Any) -> Any:
    from replicas.schema_oneof import UnresolvedRef, resolve_pointer
    for _ in range(32):
        if not (isinstance(node, dict) and isinstance(node.get("$ref"), str) and set(node) <= _ANNOTATIONS | {"$ref"}):
            return node
        try:
            node = resolve_pointer(root, node["$ref"])
        except UnresolvedRef:
            raise _Unsupported from None
    raise _Unsupported


def _extendable(node: Any, root: Any, depth: int = 0) -> None:
    """Raise :class:`_Unsupported` unless every instance of ``node`` can be continued, at the
    byte that would end it, into a different instance (module doc; ``true`` / ``false`` /
    ``null`` and the integer 0 excepted: refused at their first byte instead)."""
    from replicas.regex_complement import extendable
    from replicas.schema_oneof import UnresolvedRef, resolve_pointer
    if node is True or node is False:
        return
    if not isinstance(node, dict) or depth > 32:
        raise _Unsupported
    keys = {k for k in node if not k.startswith("x-")}
    if keys - _EXTENDABLE or node.get("additionalProperties") is False or node.get("items") is False:
        raise _Unsupported
    if isinstance(node.get("items"), list) or "format" in node and node["format"] not in _EXTENDABLE_FORMATS:
        raise _Unsupported
    for k in ("minimum", "exclusiveMinimum"):
        v = node.get(k)
        if k in node and not (isinstance(v, bool) or isinstance(v, (int, float)) and v >= 0):
            raise _Unsupported   # (draft 4's boolean exclusiveMinimum qualifies its minimum)
    if isinstance(node.get("patternProperties"), dict) and any(v is False for v in node["patternProperties"].values()):
        raise _Unsupported
    members = [m for k in ("anyOf", "oneOf", "allOf") for m in (node.get(k) or [])]
    patterns = [node] + (node.get("allOf") or [])
    if sum(isinstance(m, dict) and "pattern" in m for m in patterns) > 1:
        raise _Unsupported   # two patterns' continuations may not meet
    if "pattern" in node and not (isinstance(node["pattern"], str) and extendable(node["pattern"])):
        raise _Unsupported
    if "$ref" in node:
        if not isinstance(node["$ref"], str):
            raise _Unsupported
        try:
            members.append(resolve_pointer(root, node["$ref"]))
        except UnresolvedRef:
            raise _Unsupported from None
    for m in members:
        _extendable(m, root, depth + 1)


def _numbers(node: Any, root: Any, depth: int = 0) -> int:
    """The numbers ``node`` admits: 0 none, 1 integers only, 2 any."""
    node = _resolve(node, root)
    if node is False:
        return 0
    if not isinstance(node, dict) or depth > 32:
        return 2
    t = node.get("type")
    types = set(t) if isinstance(t, list) else {t} if isinstance(t, str) else None
    own = 2 if types is None or "number" in types else 1 if "integer" in types else 0
    for k in ("anyOf", "oneOf"):
        if isinstance(node.get(k), list) and node[k]:
            own = min(own, max(_numbers(m, root, depth + 1) for m in node[k]))
    for m in node.get("allOf") or []:
        own = min(own, _numbers(m, root, depth + 1))
    if isinstance(node.get("$ref"), str) and set(node) - _ANNOTATIONS != {"$ref"}:
        from replicas.schema_oneof import UnresolvedRef, resolve_pointer
        try:
            own = min(own, _numbers(resolve_pointer(root, node["$ref"]), root, depth + 1))
        except UnresolvedRef:
            pass
    return own


def _item_values(node: dict, root: Any) -> tuple:
    """What a unique array ``node`` may hold, for the check: ``(values, integers_only)``,
    ``values`` the frozenset of an ``enum`` / ``const`` of plain strings (looked ahead), else
    None (extendable items, :func:`_extendable`), and whether the items' numbers are integers
    only (their 0 cannot be continued). Raises :class:`_Unsupported` otherwise."""
    if any(k in node for k in ("prefixItems", "additionalItems", "contains")) or isinstance(node.get("items"), list):
        raise _Unsupported
    raw = node.get("items", True)
    items = _resolve(raw, root)
    if isinstance(items, dict):
        values = items["enum"] if isinstance(items.get("enum"), list) else [items["const"]] if "const" in items else None
        if (values and all(_plain(v) for v in values) and items.get("type", "string") == "string"
                and set(items) <= _FREE | {"enum", "const"}):
            return frozenset(values), False
        t = items.get("type")
        if isinstance(t, (str, list)) and set([t] if isinstance(t, str) else t) <= {"boolean", "null"}:
            raise _Unsupported   # finite and not continued: schema_collections writes those out
    _extendable(raw, root)
    return None, _numbers(raw, root) == 1


def _closed(node: dict) -> bool:
    return node.get("additionalProperties") is False and not node.get("patternProperties")


def _counted_on_text(node: dict) -> bool:
    """Whether ``node``'s ``minProperties`` / ``maxProperties`` need the text check: llguidance
    enforces them only on objects closed to their declared names, all of them required."""
    if "minProperties" not in node and "maxProperties" not in node:
        return False
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    return not (_closed(node) and set(props) <= set(node.get("required") or []))


_CLOSED_KEYS = _ANNOTATIONS | {"type", "properties", "required", "additionalProperties", "minProperties", "maxProperties"}


def _declared_names(node: dict) -> tuple | None:
    """``((name, required), ...)`` in declared order for a closed object whose names llguidance
    writes in that order (only plain names, nothing but ``properties`` / ``required`` deciding
    them), else None."""
    props = node.get("properties")
    if not isinstance(props, dict) or set(node) - _CLOSED_KEYS or not all(_plain(k) for k in props):
        return None
    required = set(node.get("required") or [])
    return tuple((k, k in required) for k in props)


def _takes_new_name(node: dict) -> bool:
    """Whether an object of ``node`` can always take one more property, under a name not used
    yet: ``additionalProperties`` other than ``false``, or a ``patternProperties`` pattern that
    matches names without end (:func:`replicas.regex_complement.extendable`)."""
    from replicas.regex_complement import extendable
    if node.get("additionalProperties") is not False:
        return True
    pp = node.get("patternProperties")
    return isinstance(pp, dict) and any(v is not False and extendable(k) for k, v in pp.items())


def check_paths(root: Any) -> frozenset | None:
    """What the text check enforces, as ``(instance path, check)`` pairs: ``("items", values,
    integers_only)`` for ``root``'s arrays with ``uniqueItems: true`` (module doc,
    :func:`_item_values`), ``("properties", min, max, names)`` for objects whose
    ``minProperties`` / ``maxProperties`` llguidance cannot enforce (:func:`_counted_on_text`;
    ``max`` None where there is none; ``names`` the declared ``(name, required)`` pairs of a
    closed object, followed name by name, :func:`_next_names`, else None). None where an array
    holds other items, an array or object is at a place this cannot name (under a recursion: a
    cycle whose schemas hold a check), one place may be asked two checks, or a count could leave
    an object without a way forward: ``minProperties`` where an open object at that place cannot
    take a new name (:func:`_takes_new_name`), ``maxProperties`` where one has ``required``
    names (the last comma allowed may come before them), a closed object beside others at that
    place or with names llguidance does not write in declared order (:func:`_declared_names`).
    An empty set: nothing to check."""
    from replicas.schema_oneof import UnresolvedRef, resolve_pointer
    unique: dict = {}
    counts: dict = {}
    objects: dict = {}   # path -> the object schemas found there
    visits = 0

    def walk(node: Any, path: tuple, stack: frozenset) -> None:
        nonlocal visits
        if not isinstance(node, dict):
            return
        visits += 1
        if visits > MAX_VISITS:
            raise _Unsupported
        if id(node) in stack:   # a recursive schema: fine where nothing below repeats a check
            cycles.append(node)
            return
        stack = stack | {id(node)}
        if "$ref" in node:
            if not isinstance(node["$ref"], str):
                raise _Unsupported
            try:
                walk(resolve_pointer(root, node["$ref"]), path, stack)
            except UnresolvedRef:
                raise _Unsupported from None
        if node.get("uniqueItems") is True:
            values = ("items",) + _item_values(node, root)
            if unique.setdefault(path, values) != values:
                raise _Unsupported   # two kinds of items asked at one place
        if any(k in node for k in ("properties", "additionalProperties", "patternProperties", "required",
                                    "minProperties", "maxProperties")):
            objects.setdefault(path, []).append(node)
        if _counted_on_text(node):
            count = ("properties", node.get("minProperties", 0), node.get("maxProperties"))
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in count[1:] if v is not None):
                raise _Unsupported
            if counts.setdefault(path, count) != count:
                raise _Unsupported
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

    cycles: list = []
    try:
        walk(root, (), frozenset())
    except (_Unsupported, RecursionError):
        return None
    if any(_has_checks(node, root) for node in cycles):
        return None   # a check inside the recursion: at places without end
    for table in (unique, counts):
        for (a, va), (b, vb) in itertools.combinations(table.items(), 2):
            if va != vb and _overlap(a, b):
                return None   # one place could be asked two checks
    for path, (_, lo, hi) in list(counts.items()):
        there = [n for other, nodes in objects.items() if other == path or _overlap(other, path) for n in nodes]
        if any(_closed(n) for n in there):
            names = _declared_names(there[0]) if len(there) == 1 else None
            if names is None:
                return None   # closed objects the look-ahead cannot follow
            counts[path] = ("properties", lo, hi, names)
            continue
        for node in there:
            if lo > 0 and not _takes_new_name(node):
                return None
            if hi is not None and node.get("required"):
                return None
        counts[path] = ("properties", lo, hi, None)
    return frozenset(unique.items()) | frozenset(counts.items())


def _has_checks(node: Any, root: Any) -> bool:
    """Whether ``node`` or a schema under it (local ``$ref`` followed) has ``uniqueItems: true``
    or a count the text would check (True too where it cannot tell)."""
    from replicas.schema_oneof import UnresolvedRef, resolve_pointer
    seen: set = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if isinstance(n, list):
            todo += n
            continue
        if not isinstance(n, dict) or id(n) in seen:
            continue
        seen.add(id(n))
        if len(seen) > MAX_VISITS or n.get("uniqueItems") is True or _counted_on_text(n):
            return True
        if isinstance(n.get("$ref"), str):
            try:
                todo.append(resolve_pointer(root, n["$ref"]))
            except UnresolvedRef:
                return True
        todo += [v for k, v in n.items() if isinstance(v, (dict, list)) and k not in ("enum", "const", "default", "examples")]
    return False


def remove_checked(root: Any) -> frozenset | None:
    """Remove from ``root`` (in place) the keywords :func:`check_paths` leaves to the text check
    (``uniqueItems: true``; ``minProperties`` / ``maxProperties`` where llguidance cannot enforce
    them) and return those paths (None, ``root`` unchanged, where it cannot check them all)."""
    from replicas.grammar import _walk
    paths = check_paths(root)
    if not paths:
        return paths
    for node, _ in _walk(root):
        if node.get("uniqueItems") is True:
            del node["uniqueItems"]
        if _counted_on_text(node):
            node.pop("minProperties", None)
            node.pop("maxProperties", None)
    return paths


def _overlap(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x == y or (ANY_KEY in (x, y) and ITEM not in (x, y)) for x, y in zip(a, b))


def _matches(pattern: tuple, path: tuple) -> bool:
    return len(pattern) == len(path) and all(
        p == s or (p == ANY_KEY and isinstance(s, str)) for p, s in zip(pattern, path))


def _key(v: Any) -> Any:
    """A hashable key equal for the values ``jsonschema``'s ``uniqueItems`` calls equal: numbers
    by value (``1`` and ``1.0``), booleans apart from numbers, objects whatever their key order."""
    if isinstance(v, bool) or v is None:
        return ("c", v)
    if isinstance(v, (int, float)):
        return ("n", v)
    if isinstance(v, str):
        return ("s", v)
    if isinstance(v, list):
        return ("l", tuple(map(_key, v)))
    return ("o", frozenset((k, _key(x)) for k, x in v.items()))


def _next_names(frame: dict) -> list[str]:
    """The names a closed counted object (declared ``names``, llguidance writes them in order
    and skips no required one) may take next such that its count can still end within
    ``min`` .. ``max``: name ``j`` with ``c + 1 + (names after j) >= min`` and ``c + 1 +
    (required names after j) <= max``, ``c`` the names written. Taking one keeps the next step
    possible (the following name, or the next required one, qualifies again)."""
    names, c, lo, hi = frame["names"], len(frame["keys"]), frame["min"], frame["max"]
    out = []
    for j in range(frame["pos"] + 1, len(names)):
        after = len(names) - j - 1
        if c + 1 + after >= lo and (hi is None or c + 1 + sum(r for _, r in names[j + 1:]) <= hi):
            out.append(names[j][0])
        if names[j][1]:
            break   # a required name cannot be skipped
    return out


_LITERALS = {0x74: True, 0x66: False, 0x6E: None}   # t f n
_ENDS = b",]} \t\r\n"


class _Scan:
    """JSON text scanned byte by byte: the open objects / arrays with their instance paths, and
    for each array that must be unique the keys (:func:`_key`) of its items so far.
    :meth:`feed` returns False (and stops) at a byte that ends a repeated item, or starts one
    that cannot be continued (``true`` / ``false`` / ``null``, an integer's 0)."""

    def __init__(self, paths: frozenset):
        self.paths = paths
        self.stack: list[dict] = []
        self.in_str = self.esc = False
        self.raw = b""
        self.role = None    # "key" / "value" of the open string
        self.item_of = None  # the unique array frame the open string is an item of
        self.scalar = None   # (unique array frame, start) of an open number / literal item
        self.text = b""     # the bytes since the outermost open unique array opened
        self.depth = 0      # checked frames open (unique arrays, counted objects)
        self.arrays = 0     # unique arrays open (their items' text is kept)

    def copy(self) -> "_Scan":
        c = _Scan.__new__(_Scan)
        c.__dict__.update(self.__dict__)
        frames = {id(f): dict(f) for f in self.stack}   # (a frame's set is replaced, never changed in place)
        c.stack = [frames[id(f)] for f in self.stack]
        if self.item_of is not None:
            c.item_of = frames[id(self.item_of)]
        if self.scalar is not None:
            c.scalar = (frames[id(self.scalar[0])], self.scalar[1])
        return c

    def _child_path(self) -> tuple:
        if not self.stack:
            return ()
        top = self.stack[-1]
        return top["path"] + ((top["key"],) if top["kind"] == "obj" else (ITEM,))

    def viable(self) -> bool:
        """Whether an array of an ``enum`` can still be finished: an open item is the start of a
        value not used yet, and an item after a comma has one left to be; and whether a closed
        counted object can: an open name is the start of one :func:`_next_names` allows."""
        top = self.stack[-1] if self.stack else None
        if top is not None and top["kind"] == "obj" and top["names"] is not None and self.in_str and self.role == "key":
            partial = self.raw.decode("ascii", "replace")
            return any(n.startswith(partial) for n in _next_names(top))
        if top is None or top["kind"] != "arr" or top.get("values") is None:
            return True
        left = [v for v in top["values"] if _key(v) not in top["seen"]]
        if self.in_str:
            partial = b'"' + self.raw
            return any(json.dumps(v).encode().startswith(partial) for v in left)
        return top["expect"] != "item" or bool(left)

    @staticmethod
    def _add(frame: dict, value: Any) -> bool:
        """Record ``value`` as an item of unique array ``frame``; False where it repeats one."""
        key = _key(value)
        if key in frame["seen"]:
            return False
        frame["seen"] = frame["seen"] | {key}
        return True

    def _item_start(self, top: dict | None) -> bool:
        return top is not None and top["kind"] == "arr" and top["unique"] and top["expect"] in ("first", "item")

    def feed(self, data: bytes) -> bool:
        base = len(self.text)
        if self.arrays or 0x5B in data:
            self.text += data
        for i, c in enumerate(data):
            pos = base + i
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
                        if top["checked"]:
                            if top["names"] is not None and value not in _next_names(top):
                                return False
                            top["keys"] = top["keys"] | {value}
                            if top["names"] is not None:
                                top["pos"] = next((j for j, (n, _) in enumerate(top["names"]) if n == value), top["pos"])
                    elif self.item_of is not None and not self._add(self.item_of, value):
                        return False
                    self.item_of = None
                    if top is not None and top["kind"] == "arr":
                        top["expect"] = "sep"
                    continue
                self.raw += bytes((c,))
                continue
            top = self.stack[-1] if self.stack else None
            if self.scalar is not None:
                frame, at = self.scalar
                if c not in _ENDS:
                    if frame["int_only"] and self.text[at:pos + 1] in (b"0", b"-0") and _key(0) in frame["seen"]:
                        return False   # an integer 0 again: nothing may follow it
                    continue
                self.scalar = None
                if self.text[at] not in _LITERALS:   # a number ends here
                    try:
                        value = json.loads(self.text[at:pos])
                    except ValueError:
                        value = None
                    if value is not None and not self._add(frame, value):
                        return False
            if c == 0x22:
                self.in_str, self.raw = True, b""
                self.role = "key" if top is not None and top["kind"] == "obj" and top["expect"] == "key" else "value"
                if self.role == "key" and (top["max"] is not None and len(top["keys"]) >= top["max"]
                                           or top["names"] is not None and not _next_names(top)):
                    return False   # (maxProperties 0; a closed object with no name left to take)
                self.item_of = top if self._item_start(top) else None
            elif c in (0x7B, 0x5B):   # { [
                path = self._child_path()
                if self._item_start(top):
                    top["at"] = pos
                if c == 0x7B:
                    hits = [v for p, v in self.paths if v[0] == "properties" and _matches(p, path)]
                    _, lo, hi, names = hits[0] if hits else (None, 0, None, None)
                    self.stack.append({"kind": "obj", "path": path, "key": None, "expect": "key", "checked": bool(hits),
                                       "min": lo, "max": hi, "keys": frozenset(), "names": names, "pos": -1})
                else:
                    hits = [v for p, v in self.paths if v[0] == "items" and _matches(p, path)]
                    _, values, int_only = hits[0] if hits else (None, None, False)
                    self.stack.append({"kind": "arr", "path": path, "seen": frozenset(), "unique": bool(hits),
                                       "checked": bool(hits), "values": values, "int_only": int_only,
                                       "expect": "first", "at": None})
                self.depth += bool(hits)
                self.arrays += bool(hits) and c == 0x5B
            elif c in (0x7D, 0x5D):   # } ]
                if self.stack:
                    closed = self.stack.pop()
                    self.depth -= closed["checked"]
                    self.arrays -= closed["checked"] and closed["kind"] == "arr"
                    if closed["kind"] == "obj" and len(closed["keys"]) < closed["min"]:
                        return False   # minProperties not met yet
                top = self.stack[-1] if self.stack else None
                if top is not None and top["kind"] == "arr":
                    if top["unique"] and top["at"] is not None:   # an object / array item ends
                        try:
                            value = json.loads(self.text[top["at"]:pos + 1])
                        except ValueError:
                            value = None
                        top["at"] = None
                        if value is not None and not self._add(top, value):
                            return False
                    top["expect"] = "sep"
            elif c == 0x2C and top is not None:   # ,
                if top["kind"] == "obj" and (top["max"] is not None and len(top["keys"]) >= top["max"]
                                             or top["names"] is not None and not _next_names(top)):
                    return False   # a property past maxProperties would follow (or none can)
                top["expect"] = "key" if top["kind"] == "obj" else "item"
            elif c == 0x3A and top is not None and top["kind"] == "obj":   # :
                top["expect"] = "value"
            elif c not in _ENDS and self._item_start(top):   # a number or literal item starts
                self.scalar = (top, pos)
                top["expect"] = "sep"
                if c in _LITERALS and not self._add(top, _LITERALS[c]):
                    return False
                if c == 0x30 and top["int_only"] and _key(0) in top["seen"]:
                    return False
        if not self.arrays:
            self.text = b""
        return True


MARK_EVERY = 32   # tokens between the scan snapshots :class:`TextCheckedMatcher` keeps for rollback


class TextCheckedMatcher:
    """A :class:`replicas.grammar.Matcher` (``inner``) with a check on the accepted text: a
    scanner (``new_scan()``: ``feed(bytes) -> bool``, ``copy()``) fed the bytes of each accepted
    token (``token_bytes[t]``); a token whose bytes :meth:`_blocked` refuses is refused by
    :meth:`accept_token`; rollback rebuilds the scan from the last snapshot it keeps (a copy of
    the scan every :data:`MARK_EVERY` tokens) and the bytes after it, so a rollback costs at most
    that many tokens' bytes, not the whole text (the soundness bench's key-order search rolls
    back thousands of times per text: rebuilding from the start was 80 % of its time). Subclasses give
    ``_blocked`` and ``restrict`` (the step's bitmask), and use :meth:`_only_stop` where a mask
    ends empty."""

    def __init__(self, inner, token_bytes: list, stop_ids: list, new_scan):
        self.inner, self.backend, self.native = inner, inner.backend, inner.native
        self._bytes, self._stop, self._new_scan = token_bytes, set(stop_ids), new_scan
        self._scan = new_scan()
        self._text = bytearray()
        self._lens: list[int] = []   # bytes of each accepted token (each step the inner rollback counts)
        self._marks: list[tuple] = []   # (tokens, bytes, a copy of the scan there), every MARK_EVERY tokens

    @property
    def masked(self) -> bool:
        return self.inner.masked

    @masked.setter
    def masked(self, value: bool) -> None:
        self.inner.masked = value

    def _blocked(self, data: bytes) -> bool:
        raise NotImplementedError

    def _refuses(self, scan, data: bytes) -> bool:
        """Whether ``scan`` (fed in place) refuses ``data``."""
        return not scan.feed(data)

    def accept_token(self, token: int) -> bool:
        if token in self._stop:
            ok = self.inner.accept_token(token)
            if ok:
                self._took(b"", [0])
            return ok
        data = self._bytes[token]
        if self._blocked(data) or not self.inner.accept_token(token):
            return False
        self._took(data, [len(data)])
        return True

    def _took(self, data: bytes, lens: list[int]) -> None:
        """Record accepted ``data`` (``lens``: its bytes per step the inner rollback counts)."""
        self._scan.feed(data)
        self._text += data
        self._lens += lens
        if len(self._lens) >= (self._marks[-1][0] if self._marks else 0) + MARK_EVERY:
            self._marks.append((len(self._lens), len(self._text), self._scan.copy()))

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)
        if num_tokens:   # the scan is rebuilt from the last snapshot at or before the point kept
            keep = max(len(self._lens) - num_tokens, 0)
            del self._lens[keep:]
            del self._text[sum(self._lens):]
            while self._marks and self._marks[-1][0] > keep:
                self._marks.pop()
            start = self._marks[-1][1] if self._marks else 0
            self._scan = self._marks[-1][2].copy() if self._marks else self._new_scan()
            self._scan.feed(bytes(self._text[start:]))

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def find_jump_forward_string(self) -> str:
        s = self.inner.find_jump_forward_string()
        if not s or not self._blocked(s.encode()):
            return s
        scan = self._scan.copy()
        for i, ch in enumerate(s):   # cut before a character the check would refuse
            if self._refuses(scan, ch.encode()):
                return s[:i]
        return s

    def _only_stop(self, row: torch.Tensor) -> None:
        """Allow only the stop tokens in ``row`` (int32 bitmask words)."""
        for t in self._stop:
            word, bit = divmod(t, 32)
            w = (int(row[word]) & 0xFFFFFFFF) | (1 << bit)
            row[word] = w - (1 << 32) if w >= 1 << 31 else w


class CheckedMatcher(TextCheckedMatcher):
    """A :class:`replicas.grammar.Matcher` (``inner``) with the module's checks at ``paths``
    (:func:`check_paths`). ``token_bytes[t]``: token ``t``'s bytes; ``quote_ids``: int64 ids of
    the tokens holding a ``"`` (inside a string, the only ones that can leave it), ``exit_ids``
    those with a ``,`` ``]`` ``}`` ``[`` or ``{`` after a ``"`` (the only ones that can leave a
    string and then end or open something checked)."""

    def __init__(self, inner, paths: frozenset, token_bytes: list, quote_ids: torch.Tensor,
                 exit_ids: torch.Tensor, stop_ids: list):
        super().__init__(inner, token_bytes, stop_ids, lambda: _Scan(paths))
        self._quotes, self._exits = quote_ids, exit_ids

    def _blocked(self, data: bytes) -> bool:
        """Whether ``data`` would end a repeated item (or start one that cannot go on), end an
        object short of its ``minProperties``, start a property past its ``maxProperties``, or
        leave an enum's array unfinishable."""
        return self._refuses(self._scan.copy(), data)

    def _refuses(self, scan, data: bytes) -> bool:
        return not scan.feed(data) or not scan.viable()

    def accept_string(self, text: str) -> bool:
        data = text.encode()
        if self._blocked(data):
            return False
        ids = self.inner._tok.tokenize_str(text)
        if not self.inner.accept_string(text):
            return False
        self._took(data, [len(self._bytes[t]) for t in ids])
        return True

    @torch.inference_mode()   # (the engine's bitmask buffer may be an inference tensor)
    def restrict(self, row: torch.Tensor) -> None:
        """Clear, in ``row`` (this matcher's int32 bitmask words), the tokens the check refuses
        (:meth:`_blocked`); if nothing is left, allow only the stop tokens. Looked at: outside
        strings and in an enum's item, every token the grammar allows (few there); in a string
        that is an item of a unique array, the tokens with a quote; in any other string, the
        tokens that leave it and then end or open something."""
        scan = self._scan
        top = scan.stack[-1] if scan.stack else None
        if not scan.in_str or top is not None and (top["kind"] == "arr" and top["values"] is not None
                                                   or top["kind"] == "obj" and top["names"] is not None):
            words = row.nonzero().flatten()
            bits = ((row[words].unsqueeze(1).long() & 0xFFFFFFFF) >> torch.arange(32)) & 1
            allowed = (words.unsqueeze(1) * 32 + torch.arange(32))[bits.bool()].tolist()
            allowed = [t for t in allowed if t < len(self._bytes) and t not in self._stop]
        else:
            ids = self._quotes if scan.item_of is not None else self._exits
            allowed = ids[((row[ids // 32] >> (ids % 32)) & 1).bool()].tolist()
        cleared = False
        for t in allowed:
            if self._blocked(self._bytes[t]):
                word, bit = divmod(t, 32)
                w = (int(row[word]) & 0xFFFFFFFF) & ~(1 << bit)
                row[word] = w - (1 << 32) if w >= 1 << 31 else w
                cleared = True
        if cleared and not bool(row.any()):
            self._only_stop(row)
