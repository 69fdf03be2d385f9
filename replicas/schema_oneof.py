"""``oneOf`` as ``anyOf``, exactly: for llguidance, which refuses a ``oneOf`` it cannot prove
disjoint (and compiling it as ``anyOf`` would accept an instance matching two members).

``oneOf: [A, B, ...]`` (inside a node ``P``, the node's other keywords) means exactly one member
holds. It is rewritten, in place, as ``anyOf: [A', B', ...]`` with
``A' = allOf: [A, not B, ...]`` for every member ``B`` that may overlap ``A`` (given ``P``); a
member that provably cannot overlap (:func:`disjoint`) needs no negation, so a ``oneOf`` whose
members are pairwise disjoint becomes its ``anyOf`` unchanged. ``not B`` is written in keywords
llguidance enforces (:func:`negate`), exact for every instance of ``P`` and ``A``: e.g.
``not {required: [x, y]}`` is ``anyOf: [{type: object, properties: {x: false}}, {type: object,
properties: {y: false}}]``. Where a negation cannot be written exactly (a ``pattern``, a
``format``, a nested ``oneOf``, ``integer`` inside ``number``, ...) the ``oneOf`` is left as it
is, and llguidance refuses it (or proves it disjoint itself).

Narrowing (only where the caller of :func:`rewrite_one_of` allows it): two negations that JSON
Schema cannot write for an unbounded context are written for part of the instances that fail, so
the branch ``A and not B`` accepts a subset of what it should (sound: nothing outside the
``oneOf`` is accepted; incomplete: some valid instances cannot be produced), and the caller is
told which. "An item fails ``items: S``" needs ``contains`` (llguidance has none) where the
context does not bound the array's length: it is written for the first :data:`NARROW_POSITIONS`
positions (an array whose first failing item comes later is not produced). "A property outside
``properties`` fails ``additionalProperties: S``" needs "some other name" where the context's
objects are open: it is written for the names the context itself declares or requires (an object
whose only extra property has another name is not produced); with no such name it is refused.
Two more, each only where the caller asks (:func:`rewrite_one_of`'s ``mode``; the compiler asks
for them in turn where llguidance refused the exact rewrite): ``"partial"`` writes each keyword's
negation that can be written and leaves out those that cannot (a ``pattern``, a ``format``, a
nested ``oneOf``, ...): "fails B" becomes "fails B by one of the keywords that can be negated" (an
instance failing B only by a keyword left out is not produced; where nothing is left the
``oneOf`` is refused, not a branch dropped). ``"required"`` writes "fails B" as "lacks a name B
requires" (``properties: {name: false}``, for each name B requires and the branch does not)
wherever B requires one, the smallest rewrite, for a ``oneOf`` whose exact negations multiplied
out past llguidance's bound ("schema too large"): an object with every such name, B failed by
another keyword, is not produced. Each is sound for the reason the others are: a negation is
only ever used positively (no ``not`` is written), so leaving alternatives out accepts less.

Reasoning is on "facets": a schema node is the conjunction of its keywords and of the nodes its
local ``$ref`` points to (llguidance intersects a ``$ref`` with its siblings, as Draft 2020-12
does). What is derived from a facet list (the JSON types it allows, the values of a
``const`` / ``enum``, the names it requires or forbids, whether its objects are closed) is true of
every instance; keywords not understood are left out, which only weakens it.
"""

from __future__ import annotations

import functools
import itertools
import json
import threading
from typing import Any

# Kinds of JSON values: "int" is an integer-valued number, "frac" any other number.
_KINDS = frozenset(("null", "boolean", "object", "array", "string", "int", "frac"))
_TYPE_KINDS = {"null": {"null"}, "boolean": {"boolean"}, "object": {"object"}, "array": {"array"},
               "string": {"string"}, "integer": {"int"}, "number": {"int", "frac"}}
# The keywords that constrain an instance, in any draft: any other keyword is an annotation
# (validators ignore it: title, description, examples, x-..., unknown names).
_ASSERTIONS = {"type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
               "maxLength", "minLength", "pattern", "format", "maxItems", "minItems", "uniqueItems", "maxContains",
               "minContains", "maxProperties", "minProperties", "required", "dependentRequired", "dependencies",
               "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "dependentSchemas", "prefixItems", "items",
               "additionalItems", "contains", "properties", "patternProperties", "additionalProperties",
               "propertyNames", "unevaluatedItems", "unevaluatedProperties", "$ref", "$dynamicRef", "$recursiveRef",
               "disallow", "extends", "divisibleBy"}
MAX_ALTERNATIVES = 64   # per negation (a product of anyOf negations past it is not written)
MAX_POSITIONS = 16   # array lengths up to which "an item fails S" is written position by position
NARROW_POSITIONS = 8   # positions "an item fails S" is written for where the length is unbounded (narrowing)
MAX_REWRITE_CHARS = 100_000   # JSON characters of one oneOf's rewritten branches
MAX_VALUES = 256   # values of a finite context (enum / const) negated by evaluating each


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "int" if v.is_integer() else "frac"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


def _canon(v: Any) -> str:
    """A value's identity as JSON Schema compares values (1 == 1.0, true != 1)."""
    def norm(x):
        if isinstance(x, float) and x.is_integer():
            return int(x)
        if isinstance(x, list):
            return [norm(y) for y in x]
        if isinstance(x, dict):
            return {k: norm(y) for k, y in x.items()}
        return x
    return json.dumps(norm(v), sort_keys=True)


class UnresolvedRef(Exception):
    """A ``$ref`` that is not a local JSON pointer into the schema, or points nowhere."""


def resolve_pointer(root: Any, ref: str) -> Any:
    """The node of ``root`` that the local ``$ref`` ``ref`` (``#`` or ``#/a/0/b``, RFC 6901
    escapes) names. Raises :class:`UnresolvedRef`."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        raise UnresolvedRef(ref)
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError, TypeError):
            raise UnresolvedRef(ref) from None
    return node


def facets(node: Any, root: Any, depth: int = 0) -> list:
    """``node`` as a conjunction: itself (without ``$ref`` and ``allOf``), its ``allOf``
    members and what its local ``$ref`` chain points to. Raises :class:`UnresolvedRef` for a ``$ref`` it cannot follow."""
    if depth > 32:
        raise UnresolvedRef("too deep")
    if node is True or node is False:
        return [node]
    if not isinstance(node, dict):
        return [{}]
    ref, all_of = node.get("$ref"), node.get("allOf")
    if not isinstance(ref, str) and not isinstance(all_of, list):
        return [node]
    out = [{k: v for k, v in node.items() if k not in ("$ref", "allOf") or not isinstance(v, (str, list))}]
    for m in all_of if isinstance(all_of, list) else []:
        out += facets(m, root, depth + 1)
    return out + (facets(resolve_pointer(root, ref), root, depth + 1) if isinstance(ref, str) else [])


_MEMBER_DEPTH = 2   # anyOf / oneOf levels Info looks into


class Info:
    """What every instance of a facet list satisfies (sound, not complete)."""

    def __init__(self, fs: list, root: Any, depth: int = 0):
        self.root, self.facets, self.depth = root, fs, depth
        self.false = any(f is False for f in fs)
        self.kinds = set(_KINDS)
        self.values = None   # {canon: value} or None (any)
        self.required: set = set()
        self.closed = None   # the names an object may have, or None (any)
        self.members: list[list[Info]] = []   # per anyOf / oneOf facet, its members' Info (one holds)
        for f in fs:
            if not isinstance(f, dict):
                continue
            t = f.get("type")
            if isinstance(t, (str, list)):
                names = [t] if isinstance(t, str) else t
                if all(n in _TYPE_KINDS for n in names):
                    self.kinds &= set().union(*(_TYPE_KINDS[n] for n in names)) if names else set()
            vals = [f["const"]] if "const" in f else f["enum"] if isinstance(f.get("enum"), list) else None
            if vals is not None:
                got = {_canon(v): v for v in vals}
                self.values = got if self.values is None else {k: v for k, v in self.values.items() if k in got}
            if isinstance(f.get("required"), list):
                self.required |= {r for r in f["required"] if isinstance(r, str)}
            for k in ("anyOf", "oneOf"):   # an instance satisfies one member at least: its kinds, values
                if isinstance(f.get(k), list) and depth < _MEMBER_DEPTH:
                    members = [self._member(m) for m in f[k]]
                    self.members.append(members)
                    self.kinds &= set().union(*(m.kinds for m in members))
                    if members and all(m.values is not None for m in members):
                        got = {c: v for m in members for c, v in m.values.items()}
                        self.values = got if self.values is None else {c: v for c, v in self.values.items() if c in got}
            if f.get("additionalProperties") is False and not f.get("patternProperties"):
                names = set(f.get("properties") or {}) if isinstance(f.get("properties", {}), dict) else set()
                self.closed = names if self.closed is None else self.closed & names
        if self.values is not None:
            self.values = {k: v for k, v in self.values.items() if _kind(v) in self.kinds}
            self.kinds &= {_kind(v) for v in self.values.values()}
        if self.closed is not None:
            self.closed = {n for n in self.closed if not self.forbids(n)}

    def empty(self) -> bool:
        return self.false or not self.kinds

    def forbids(self, name: str) -> bool:
        """Whether no object instance has property ``name``."""
        for f in self.facets:
            if not isinstance(f, dict):
                continue
            props = f.get("properties") if isinstance(f.get("properties"), dict) else {}
            if name in props:
                if props[name] is False:
                    return True
                continue
            if f.get("additionalProperties") is False and not f.get("patternProperties"):
                return True
        return False

    def declared(self) -> set:
        """The names the facets' ``properties`` declare, and their ``anyOf`` / ``oneOf`` members'."""
        out = {n for f in self.facets if isinstance(f, dict) and isinstance(f.get("properties"), dict)
               for n in f["properties"]}
        return out.union(*(m.declared() for members in self.members for m in members))

    def _member(self, m: Any) -> "Info":
        """What every instance of the ``anyOf`` / ``oneOf`` member ``m`` satisfies (nothing
        known where its ``$ref`` cannot be followed)."""
        try:
            return Info(facets(m, self.root), self.root, self.depth + 1)
        except UnresolvedRef:
            return Info([True], self.root, _MEMBER_DEPTH)

    def prop(self, name: str) -> list:
        """The facets an instance's property ``name`` (when present) satisfies."""
        out = []
        for f in self.facets:
            if not isinstance(f, dict):
                continue
            props = f.get("properties") if isinstance(f.get("properties"), dict) else {}
            if name in props:
                out += facets(props[name], self.root)
            elif "additionalProperties" in f and not f.get("patternProperties"):
                out += facets(f["additionalProperties"], self.root)
        return out


def _info(fs: list, root: Any) -> Info | None:
    try:
        return Info(fs, root)
    except UnresolvedRef:
        return None


def disjoint(a: list, b: list, root: Any, depth: int = 0) -> bool:
    """Whether no instance satisfies both facet lists ``a`` and ``b`` (True only when proved)."""
    return disjoint_kinds(a, b, root, depth) >= _KINDS


def disjoint_kinds(a: list, b: list, root: Any, depth: int = 0) -> set:
    """The kinds of JSON value (:data:`_KINDS`) of which no instance satisfies both facet lists
    (proved; a kind left out may still be disjoint)."""
    ia, ib = _info(a, root), _info(b, root)
    if ia is None or ib is None:
        return set()
    if ia.empty() or ib.empty():
        return set(_KINDS)
    out = set(_KINDS) - (ia.kinds & ib.kinds)
    for kind in ia.kinds & ib.kinds:
        if ia.values is not None and ib.values is not None and not {
                c for c, v in ia.values.items() if _kind(v) == kind} & set(ib.values):
            out.add(kind)
        elif kind in _RANGES and _ranges_disjoint(ia, ib, _RANGES[kind]):
            out.add(kind)
        elif kind == "string" and _prefixes_disjoint(ia, ib):
            out.add(kind)
        elif kind == "object" and depth <= 8 and _objects_disjoint(ia, ib, root, depth):
            out.add(kind)
    return out


# Length bounds per kind: (lower keyword, upper keyword); both inclusive integers.
_RANGES = {"string": ("minLength", "maxLength"), "array": ("minItems", "maxItems"),
           "object": ("minProperties", "maxProperties")}


def _bound(info: "Info", kw: str, lower: bool) -> int | None:
    vals = [f[kw] for f in info.facets if isinstance(f, dict) and isinstance(f.get(kw), int)
            and not isinstance(f.get(kw), bool)]
    return (max(vals) if lower else min(vals)) if vals else None


def _ranges_disjoint(ia: "Info", ib: "Info", kws: tuple) -> bool:
    lo_a, hi_a = _bound(ia, kws[0], True), _bound(ia, kws[1], False)
    lo_b, hi_b = _bound(ib, kws[0], True), _bound(ib, kws[1], False)
    return (hi_a is not None and lo_b is not None and hi_a < lo_b) or \
        (hi_b is not None and lo_a is not None and hi_b < lo_a)


def literal_prefix(pattern: str) -> str:
    """The characters every string ``pattern`` matches starts with ("" when none are known): the
    literal run after a leading ``^`` (with no ``|`` outside a group or class, which would let
    another branch match anywhere), up to the first metacharacter; a character that a ``?``,
    ``*`` or ``{`` makes optional is left out. Read the same by Python's ``re`` and ECMA-262 (no
    multiline flag in JSON Schema: ``^`` is the start of the string)."""
    if not isinstance(pattern, str) or not pattern.startswith("^"):
        return ""
    depth, i = 0, 0
    while i < len(pattern):   # a top-level alternation: "^a|b" matches "xb"
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            j = i + 1 + (pattern[i + 1:i + 2] == "^")
            j += pattern[j:j + 1] == "]"
            while j < len(pattern) and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            i = j + 1
            continue
        depth += (c == "(") - (c == ")")
        if c == "|" and depth == 0:
            return ""
        i += 1
    out, i = [], 1
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern) and not pattern[i + 1].isalnum() and pattern[i + 1].isprintable():
            ch, nxt = pattern[i + 1], i + 2
        elif c not in _META and c.isprintable():
            ch, nxt = c, i + 1
        else:
            break
        if pattern[nxt:nxt + 1] in ("?", "*", "{"):
            break
        out.append(ch)
        if pattern[nxt:nxt + 1] == "+":
            break
        i = nxt
    return "".join(out)


def _prefixes_disjoint(ia: "Info", ib: "Info") -> bool:
    """Whether no string satisfies both: each side's patterns fix a start (:func:`literal_prefix`)
    and two of them disagree, or every string value one side allows misses the other's start."""
    from replicas.regex_complement import pattern_misses, patterns_disjoint

    def patterns(info):
        return [f["pattern"] for f in info.facets if isinstance(f, dict) and isinstance(f.get("pattern"), str)]

    def prefixes(info):
        return [p for p in map(literal_prefix, patterns(info)) if p]
    pa, pb = prefixes(ia), prefixes(ib)
    if any(not x.startswith(y) and not y.startswith(x) for x in pa for y in pb):
        return True
    for info, other in ((ia, pb), (ib, pa)):
        if info.values is not None and other:
            strings = [v for v in info.values.values() if isinstance(v, str)]
            if all(any(not v.startswith(p) for p in other) for v in strings):
                return True
    # On automata: two patterns no string matches both, or values the other side's patterns miss.
    if any(patterns_disjoint(x, y) for x in patterns(ia) for y in patterns(ib)):
        return True
    for info, other in ((ia, patterns(ib)), (ib, patterns(ia))):
        if info.values is not None and other:
            strings = [v for v in info.values.values() if isinstance(v, str)]
            if all(any(pattern_misses(p, v) for p in other) for v in strings):
                return True
    return False


def _objects_disjoint(ia: Info, ib: Info, root: Any, depth: int) -> bool:
    """Whether no object satisfies both: a name one requires and the other forbids, or a name
    one requires whose property schemas are disjoint."""
    if any(ib.forbids(r) for r in ia.required) or any(ia.forbids(r) for r in ib.required):
        return True
    try:
        return any(disjoint(ia.prop(p), ib.prop(p), root, depth + 1) for p in sorted(ia.required | ib.required))
    except UnresolvedRef:
        return False


class _Inexpressible(Exception):
    pass


class _Narrowing(threading.local):
    sink: list | None = None   # where :func:`_narrow` records; None: narrowing not allowed
    mode = "exact"             # how a member's negation is narrowed (:func:`rewrite_one_of`)


_narrowing = _Narrowing()


def _narrow(what: str) -> None:
    """Record that a negation is written for part of the instances that fail (module doc,
    "Narrowing"); raises :class:`_Inexpressible` where the caller does not allow it."""
    if _narrowing.sink is None:
        raise _Inexpressible(what)
    _narrowing.sink.append(what)


Inexpressible = _Inexpressible   # (for the other rewrites, replicas.schema_not, ...)


def _types_for(kinds: set) -> list[str]:
    """``type`` names for exactly ``kinds`` (raises where "frac" is wanted without "int")."""
    if "frac" in kinds and "int" not in kinds:
        raise _Inexpressible("a non-integer number")
    names = [n for n in ("null", "boolean", "object", "array", "string") if n in kinds]
    if "frac" in kinds:
        names.append("number")
    elif "int" in kinds:
        names.append("integer")
    return names


def _type_schema(kinds: set) -> dict:
    names = _types_for(kinds)
    return {"type": names[0] if len(names) == 1 else names}


def negate(b: list, ctx: list, root: Any, depth: int = 0) -> list:
    """Schemas ``N1, N2, ...`` such that an instance of ``ctx`` (facet list) fails ``b`` (facet
    list) if and only if it satisfies one of them ([] where none of ``ctx`` can fail ``b``).
    Raises :class:`_Inexpressible` where this cannot be written exactly."""
    if depth > 6:
        raise _Inexpressible("nested too deep")
    ci = _info(ctx, root)
    if ci is None:
        raise _Inexpressible("an unresolved $ref")
    if ci.empty():
        return []
    if ci.values is not None and len(ci.values) <= MAX_VALUES:
        failing = _failing_values(b, ci, root)
        if failing is not None:
            return [{"enum": failing}] if failing else []
    out: list = []
    for f in b:
        if f is True or _among(f, ctx):
            continue   # (a facet the context holds too: every instance of ctx satisfies it)
        if f is False:
            return [True]
        for k, v in f.items():
            out += _negate_keyword_or_drop(k, v, f, ci, ctx, root, depth)
            if len(out) > MAX_ALTERNATIVES:
                raise _Inexpressible("too many alternatives")
    return out


def _negate_keyword_or_drop(k: str, v: Any, f: dict, ci: Info, ctx: list, root: Any, depth: int) -> list:
    """:func:`_negate_keyword`; in mode "partial", ``[]`` (narrowed) where it cannot be written:
    the instances that fail the facet only by that keyword are left out."""
    if _narrowing.mode != "partial" or _narrowing.sink is None:
        return _negate_keyword(k, v, f, ci, ctx, root, depth)
    mark = len(_narrowing.sink)
    try:
        return _negate_keyword(k, v, f, ci, ctx, root, depth)
    except _Inexpressible as e:
        del _narrowing.sink[mark:]   # (narrowed inside it, but left out whole)
        why = f" ({e})" if str(e) != k else ""
        _narrow(f"{k}: an instance that fails another member only by a `{k}`{why} is not produced")
        return []


def _failing_values(b: list, ci: Info, root: Any) -> list | None:
    """The values of the context (``ci.values``: finite) that fail the facet list ``b``, as
    ``jsonschema`` (with the format checker of ``root`` 's draft) decides; None where it cannot
    (an unresolvable reference, a keyword or value it raises on)."""
    if any(r in json.dumps(b) for r in ('"$ref"', '"$dynamicRef"', '"$recursiveRef"')):
        return None   # (resolved against the root's base here, not necessarily theirs)
    try:
        v = _format_validator(root)
        return [x for x in ci.values.values() if not all(v.evolve(schema=f).is_valid(x) for f in b)]
    except Exception:   # (jsonschema's reference, schema and type errors; then negated keyword by keyword)
        return None


def _format_validator(root: Any):
    """A ``jsonschema`` validator of ``root`` 's draft (2020-12 without ``$schema``), formats
    checked as the server enforces them."""
    import warnings

    import jsonschema
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cls = jsonschema.validators.validator_for(root if isinstance(root, (dict, bool)) else {},
                                                  default=jsonschema.Draft202012Validator)
    return cls(root if isinstance(root, (dict, bool)) else {}, format_checker=cls.FORMAT_CHECKER)


def _unique(schemas: list) -> list:
    """``schemas`` without repeats (as JSON), in order."""
    seen, out = set(), []
    for x in schemas:
        key = _canon(x)
        if key not in seen:
            seen.add(key)
            out.append(x)
    return out


def _conjunction(clauses: list[list]) -> list:
    """Schemas whose ``allOf`` holds exactly where each clause (a list of alternatives) has one
    alternative that holds, written small: a clause holding all of another's alternatives is
    dropped (absorption), and an alternative ``a`` shared by several clauses is factored out,
    ``(a or B) and (a or C) = a or (B and C)``. llguidance intersects an ``allOf`` of ``anyOf`` s
    by multiplying them out (``schema too large`` past 50,000 nodes): sibling members that
    differ from ``m`` alike negate to the same alternatives, which this keeps from multiplying."""
    clauses = [_unique(c) for c in clauses]
    keys = [frozenset(map(_canon, c)) for c in clauses]
    keep = [i for i in range(len(clauses))
            if not any(keys[j] < keys[i] or (keys[j] == keys[i] and j < i) for j in range(len(clauses)))]
    clauses, keys = [clauses[i] for i in keep], [keys[i] for i in keep]
    counts: dict = {}
    for k in keys:
        for x in k:
            counts[x] = counts.get(x, 0) + 1
    shared = max(counts, key=lambda x: (counts[x], x), default=None)
    if shared is None or counts[shared] < 2:
        return [c[0] if len(c) == 1 else {"anyOf": c} for c in clauses]
    group = [c for c, k in zip(clauses, keys) if shared in k]
    others = [c for c, k in zip(clauses, keys) if shared not in k]
    a = next(x for x in group[0] if _canon(x) == shared)
    inner = _conjunction([[x for x in c if _canon(x) != shared] for c in group])
    return [{"anyOf": [a, inner[0] if len(inner) == 1 else {"allOf": inner}]}, *_conjunction(others)]


def _among(f: Any, fs: list) -> bool:
    """Whether the facet ``f`` is one of ``fs`` (the same object or an equal one)."""
    return any(g is f for g in fs) or (isinstance(f, dict) and any(
        isinstance(g, dict) and _canon(g) == _canon(f) for g in fs))


def _lengths_within(ci: Info, k: str, v: int) -> bool:
    """Whether every string of the context meets ``k: v`` (``minLength`` / ``maxLength``) by the
    lengths its patterns allow (llguidance cannot always tell ``^[a-z]{1,255}$`` and
    ``minLength: 256`` apart: "Unable to determine if regex is empty")."""
    if k not in ("minLength", "maxLength"):
        return False
    from replicas.regex_complement import length_bounds
    for f in ci.facets:
        for fmt, lo, hi in (("ipv4", 7, 15), ("ipv6", 2, 45)):   # ("0.0.0.0", "::" .. 45 characters)
            if isinstance(f, dict) and f.get("format") == fmt and _has_format(ci, fmt, ci.root):
                if (k == "minLength" and v <= lo) or (k == "maxLength" and v >= hi):
                    return True
        if isinstance(f, dict) and isinstance(f.get("pattern"), str):
            lo, hi = length_bounds(f["pattern"])
            if (k == "minLength" and lo >= v) or (k == "maxLength" and hi is not None and hi <= v):
                return True
    return False


def _negate_keyword(k: str, v: Any, f: dict, ci: Info, ctx: list, root: Any, depth: int) -> list:
    if k not in _ASSERTIONS:
        return []
    if k == "type":
        names = [v] if isinstance(v, str) else v
        if not isinstance(names, list) or not all(n in _TYPE_KINDS for n in names):
            raise _Inexpressible("type")
        rest = ci.kinds - set().union(set(), *(_TYPE_KINDS[n] for n in names))
        return [_type_schema(rest)] if rest else []
    if k == "required":
        if not isinstance(v, list):
            raise _Inexpressible("required")
        if "object" not in ci.kinds:
            return []
        return [{"type": "object", "properties": {r: False}} for r in v if r not in ci.required]
    if k == "properties":
        if not isinstance(v, dict):
            raise _Inexpressible("properties")
        if "object" not in ci.kinds:
            return []
        out = []
        for p, s in v.items():
            if ci.forbids(p):
                continue
            try:
                sub, own = ci.prop(p), facets(s, root)
                if disjoint(sub, own, root):
                    out.append({"type": "object", "required": [p]})   # any value it may have fails
                    continue
                negs = negate(own, sub, root, depth + 1)
            except UnresolvedRef:
                raise _Inexpressible("an unresolved $ref") from None
            out += [{"type": "object", "required": [p], "properties": {p: n}} for n in negs]
        return out
    if k == "additionalProperties":
        if v is True or v == {} or "object" not in ci.kinds:
            return []
        if f.get("patternProperties"):
            raise _Inexpressible("additionalProperties")   # (which names are "other" is the patterns')
        named = set(f.get("properties") or {})
        names = ci.closed
        if names is None:   # "some other name" in open objects: the names the context declares (narrowed)
            names = {n for n in ci.declared() | ci.required if not ci.forbids(n)}
            if not names - named:
                raise _Inexpressible("additionalProperties")
            _narrow("additionalProperties: a property outside `properties` only among the names the "
                    "other members declare")
        out = []
        for name in sorted(names - named):
            if v is False:
                out.append({"type": "object", "required": [name]})
            else:
                negs = negate(facets(v, root), ci.prop(name), root, depth + 1)
                out += [{"type": "object", "required": [name], "properties": {name: n}} for n in negs]
        return out
    if k == "patternProperties" and not v:
        return []
    if k == "uniqueItems" and v is False:
        return []
    if k == "additionalItems" and not isinstance(f.get("items"), list):
        return []   # (applies only beside a tuple of items; ignored otherwise, and in 2020-12)
    if k == "not":
        return [v]   # an instance fails `not: S` exactly when it satisfies S
    if k == "format":
        return _negate_format(v, ci, root)
    if k == "pattern":
        if not isinstance(v, str):
            raise _Inexpressible(k)
        if "string" not in ci.kinds:
            return []
        if _has_format(ci, "ipv6", root) and not _may_contain(v, ":"):
            return [{"type": "string"}]   # every IPv6 address has a ":", which no string of v has
        if _has_format(ci, "ipv4", root) and v == _hostname_pattern():
            return []   # every IPv4 address is a hostname
        try:
            return [{"type": "string", "pattern": c} for c in _counted_class_complement(v)]
        except _Inexpressible:
            pass
        complement = _complement_pattern(v)
        return [{"type": "string", "pattern": complement}] if complement is not None else []
    if k == "items" and (isinstance(v, (dict, bool)) and not isinstance(f.get("prefixItems"), list)):
        # An array fails `items: S` when one of its items fails S: written only where every item
        # the context allows fails S (its items disjoint from S): then any non-empty array.
        if v is True or v == {} or "array" not in ci.kinds:
            return []
        own = [g["items"] for g in ci.facets if isinstance(g, dict) and isinstance(g.get("items"), (dict, bool))
               and not isinstance(g.get("prefixItems"), list)]
        try:
            own_facets = [x for g in own for x in facets(g, root)]
            if own and disjoint(own_facets, facets(v, root), root):
                return [{"type": "array", "minItems": 1}]
            # An item failing S, position by position, where the context bounds the length
            # and does not tell positions apart. The facet's other keywords count as context:
            # not (X and items) = not X, or (X and not items), and not X is written beside.
            cx = _info(ctx + [{x: y for x, y in f.items() if x != "items"}], root)
            if cx is None or any(isinstance(g, dict) and ("prefixItems" in g or isinstance(g.get("items"), list))
                                 for g in cx.facets):
                raise _Inexpressible("items")
            longest = _bound(cx, "maxItems", False)
            if longest is None or longest > MAX_POSITIONS:   # (needs `contains`): narrowed
                _narrow(f"items: an item failing the other member's `items` only among the first "
                        f"{NARROW_POSITIONS} positions")
                longest = NARROW_POSITIONS
            negs = negate(facets(v, root), own_facets, root, depth + 1)
        except UnresolvedRef:
            raise _Inexpressible("items") from None
        if not negs:
            return []
        item = negs[0] if len(negs) == 1 else {"anyOf": negs}
        # (the tuple as an `items` list: llguidance ignores `prefixItems` under a draft 4 to 2019-09
        # `$schema`, and reads the list form in every draft)
        return [{"type": "array", "minItems": i + 1, "items": [True] * i + [item]} for i in range(longest)]
    if k in ("const", "enum"):
        vals = [v] if k == "const" else v
        if not isinstance(vals, list):
            raise _Inexpressible(k)
        keys = {_canon(x) for x in vals}
        if ci.values is not None:
            rest = [x for c, x in ci.values.items() if c not in keys]
            return [{"enum": rest}] if rest else []
        out = []
        kinds_in = {_kind(x) for x in vals} & ci.kinds
        if kinds_in & {"int", "frac"}:
            kinds_in |= ci.kinds & {"int", "frac"}   # numbers are negated together (below)
        rest = ci.kinds - kinds_in
        if rest:
            out.append(_type_schema(rest))
        for kind in kinds_in:
            if kind == "boolean":
                left = [x for x in (True, False) if _canon(x) not in keys]
                out += [{"enum": left}] if left else []
            elif kind == "string":
                out.append({"type": "string", "pattern": _not_one_of_pattern([x for x in vals if isinstance(x, str)])})
            elif kind in ("array", "object"):
                raise _Inexpressible(f"{k} with {kind} values")
        if kinds_in & {"int", "frac"}:
            out += _not_numbers([x for x in vals if _kind(x) in ci.kinds & {"int", "frac"}], "frac" in ci.kinds)
        return out
    bounds = {"minLength": ("string", "maxLength", -1), "maxLength": ("string", "minLength", 1),
              "minItems": ("array", "maxItems", -1), "maxItems": ("array", "minItems", 1)}
    if k in bounds:
        kind, other, step = bounds[k]
        if not isinstance(v, int) or isinstance(v, bool):
            raise _Inexpressible(k)
        if kind not in ci.kinds or v + step < 0 or _lengths_within(ci, k, v):
            return []
        return [{"type": kind, other: v + step}]
    numeric = {"minimum": "exclusiveMaximum", "maximum": "exclusiveMinimum",
               "exclusiveMinimum": "maximum", "exclusiveMaximum": "minimum"}
    if k in numeric:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _Inexpressible(k)   # draft 4's boolean exclusiveMinimum
        if k in ("minimum", "maximum") and isinstance(f.get("exclusive" + k[:1].upper() + k[1:]), bool):
            raise _Inexpressible(k)
        if not ci.kinds & {"int", "frac"}:
            return []
        return [{"type": "number", numeric[k]: v}]
    if k == "allOf":
        if not isinstance(v, list):
            raise _Inexpressible(k)
        out = []
        for s in v:
            try:
                out += negate(facets(s, root), ctx, root, depth + 1)
            except UnresolvedRef:
                raise _Inexpressible("an unresolved $ref") from None
        return out
    if k == "oneOf" and isinstance(v, list):
        # exactly one member holds: as anyOf where no two members can hold together
        try:
            fs = [ctx + facets(s, root) for s in v]
        except UnresolvedRef:
            raise _Inexpressible("an unresolved $ref") from None
        if not all(disjoint(fs[i], fs[j], root) for i in range(len(v)) for j in range(i)):
            raise _Inexpressible(k)
        k = "anyOf"
    if k == "anyOf":
        if not isinstance(v, list):
            raise _Inexpressible(k)
        try:
            each = [negate(facets(s, root), ctx, root, depth + 1) for s in v]
        except UnresolvedRef:
            raise _Inexpressible("an unresolved $ref") from None
        if any(not n for n in each):
            return []   # a member that always holds
        if any(len(n) > 1 for n in each) and _product_size(each) > MAX_ALTERNATIVES:
            raise _Inexpressible("too many alternatives")
        return [c[0] if len(c) == 1 else {"allOf": list(c)} for c in itertools.product(*each)]
    raise _Inexpressible(k)


# IPv4 addresses as `jsonschema` checks them (Python's ipaddress: four decimal octets, ASCII
# digits, no leading zero)
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9][0-9]|[0-9])"
IPV4_PATTERN = f"^{_OCTET}(?:\\.{_OCTET}){{3}}$"


def _hostname_pattern() -> str:
    from replicas.grammar import _FORMAT_PATTERNS
    return _FORMAT_PATTERNS["hostname"]


def _has_format(ci: Info, fmt: str, root: Any) -> bool:
    """Whether every string of the context has ``format: fmt``, as `jsonschema` checks it in
    ``root`` 's draft."""
    from replicas.grammar import _draft_formats
    return any(isinstance(f, dict) and f.get("format") == fmt for f in ci.facets) and fmt in _draft_formats(root)


def _may_contain(pattern: str, char: str) -> bool:
    """Whether a string ``pattern`` finds a match in may contain ``char`` (False only where the
    pattern is anchored at both ends and its characters leave ``char`` out)."""
    from replicas.regex_complement import Unsupported, _anchored, alphabet
    try:
        return not _anchored(pattern) or any(a <= ord(char) <= b for a, b in alphabet(pattern))
    except (Unsupported, ValueError):
        return True


def _negate_format(v: Any, ci: Info, root: Any) -> list:
    """``not {format: v}`` where it can be written exactly: ``ipv4`` as the complement of
    :data:`IPV4_PATTERN`; ``ipv6`` where no string of the context can have a ``:`` (an IPv4
    address, a pattern without one). Else :class:`_Inexpressible`."""
    from replicas.grammar import _draft_formats
    if "string" not in ci.kinds:
        return []
    if v not in _draft_formats(root):
        return []   # an annotation in this draft: every string satisfies it
    if v == "ipv6" and (_has_format(ci, "ipv4", root) or any(
            isinstance(f, dict) and isinstance(f.get("pattern"), str) and not _may_contain(f["pattern"], ":")
            for f in ci.facets)):
        return [{"type": "string"}]
    if v == "ipv4":
        complement = _complement_pattern(IPV4_PATTERN)
        return [{"type": "string", "pattern": complement}] if complement is not None else []
    raise _Inexpressible("format")


def _not_numbers(values: list, fractions: bool) -> list:
    """The numbers (``fractions``) or integers other than ``values``: the open intervals between
    them, as exclusive bounds."""
    name = "number" if fractions else "integer"
    points = sorted({float(v) if not float(v).is_integer() else int(v) for v in values})
    if len(points) + 1 > MAX_ALTERNATIVES:
        raise _Inexpressible("too many alternatives")
    if not points:
        return [{"type": name}]
    out = [{"type": name, "exclusiveMaximum": points[0]}]
    out += [{"type": name, "exclusiveMinimum": a, "exclusiveMaximum": b} for a, b in zip(points, points[1:])
            if fractions or b - a > 1]
    return out + [{"type": name, "exclusiveMinimum": points[-1]}]


MAX_PATTERN = 20_000   # characters of a complement pattern (a longer enum is not negated)


def _regex_char(c: str) -> str:
    if c.isascii() and c.isalnum():
        return c
    if c.isascii() and c.isprintable() and c != " ":
        return "\\" + c                       # ASCII punctuation, escaped (also inside a class)
    return "\\x{%x}" % ord(c)


def _not_one_of_pattern(words: list[str]) -> str:
    """An anchored regex (no look-around) matching every string except ``words``: walking the
    trie of ``words``, a string leaves it by ending at a node that is no word's end, or by a
    character no word continues with there (then anything may follow)."""
    trie: dict = {}
    for w in words:
        node = trie
        for c in w:
            node = node.setdefault(c, {})
        node[""] = {}   # the end of a word

    def rx(node: dict) -> str:
        kids = sorted(c for c in node if c)
        alts = [] if "" in node else [""]
        alts.append(("[^" + "".join(map(_regex_char, kids)) + "]" if kids else "(?s:.)") + "(?s:.)*")
        alts += [_regex_char(c) + rx(node[c]) for c in kids]
        return "(?:" + "|".join(alts) + ")"
    pattern = "^" + rx(trie) + "$"
    if len(pattern) > MAX_PATTERN:
        raise _Inexpressible("an enum too long to negate")
    return pattern


_ANCHORS = set("bBAZzG0123456789")   # escapes that are not one character: anchors, back-references
_ALL_CHARS = None   # every Unicode scalar value, as one string (built on first use)


def _char_ranges(atom: str, flags: int) -> list[tuple[int, int]]:
    """The code points the one-character regex ``atom`` matches under Python's ``re`` with
    ``flags``, as inclusive ranges (found by running it over every code point)."""
    import re
    global _ALL_CHARS
    if _ALL_CHARS is None:
        _ALL_CHARS = "".join(map(chr, range(0xD800))) + "".join(map(chr, range(0xE000, 0x110000)))
    cp = lambda i: i if i < 0xD800 else i + 0x800   # noqa: E731 (index -> code point: no surrogates)
    return [(cp(m.start()), cp(m.end() - 1)) for m in re.finditer(f"(?:{atom})+", _ALL_CHARS, flags)]


def _complement_ranges(ranges: list) -> list:
    out, lo = [], 0
    for a, b in ranges:
        if a > lo:
            out.append((lo, a - 1))
        lo = b + 1
    return out + ([(lo, 0x10FFFF)] if lo <= 0x10FFFF else [])


def _union_ranges(a: list, b: list) -> list:
    out = []
    for lo, hi in sorted(a + b):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _class_of(ranges: list) -> str:
    def ch(c: int) -> str:
        return "\\x{%x}" % c
    return "[" + "".join(ch(a) if a == b else f"{ch(a)}-{ch(b)}" for a, b in ranges) + "]"


def _one_char_atom(p: str) -> bool:
    """Whether the regex ``p`` is one atom matching exactly one character: a class, a
    character escape (not an anchor or back-reference), ``.`` or a literal character."""
    if not p or _atom_end(p, 0) != len(p):
        return False
    if p[0] == "[":
        return len(p) > 2 and p.endswith("]")
    if p[0] == "\\":
        return len(p) == 2 and p[1] not in _ANCHORS
    return len(p) == 1 and p not in "^$|?*+(){}[]"   # (a group is not one character)


_META = set(".^$|?*+()[]{}\\")


def _anchored_literals(pattern: str) -> list[str] | None:
    """The strings of a pattern ``^L$`` / ``^(L1|L2|...)$`` / ``^(?:...)$`` of literal
    characters (and escaped punctuation), or None for any other pattern."""
    if not (pattern.startswith("^") and pattern.endswith("$")) or pattern.endswith("\\$") or len(pattern) < 2:
        return None
    body = pattern[1:-1]
    if body.startswith("(") and body and _atom_end(body, 0) == len(body):
        body = body[3:-1] if body.startswith("(?:") else None if body.startswith("(?") else body[1:-1]
        if body is None:
            return None
    words, word, i = [], "", 0
    while i < len(body):
        c = body[i]
        if c == "|":
            words.append(word)
            word, i = "", i + 1
        elif c == "\\":
            if i + 1 >= len(body) or body[i + 1].isalnum() or body[i + 1].isspace():
                return None   # \d, \n, \b, ...: not a literal here
            word, i = word + body[i + 1], i + 2
        elif c in _META or not c.isprintable():
            return None
        else:
            word, i = word + c, i + 1
    return words + [word]


MAX_CLASS = 4000   # characters of a complement class


@functools.lru_cache(maxsize=256)
def _complement_pattern(pattern: str) -> str | None:
    """An anchored regex (None: no string) matching only strings that ``pattern`` (searched, as
    JSON Schema reads it) does not match: the two shapes of :func:`_complement_shape`, else the
    general complement on automata (:func:`replicas.regex_complement.complement`). Raises
    :class:`_Inexpressible` where neither applies."""
    from replicas.regex_complement import Unsupported, complement
    try:
        return _complement_shape(pattern)
    except _Inexpressible:
        pass
    try:
        return complement(pattern)
    except Unsupported:
        raise _Inexpressible("pattern") from None


def _counted_class_complement(pattern: str) -> list[str]:
    """Anchored regexes whose union matches exactly the strings ``^C{m,n}$`` (``C`` one
    character atom without a newline; ``{m}``, ``{m,}`` too) does not match, as JSON Schema
    reads it (Python's ``$`` also matches before a final newline, so the widest reading is
    ``C{m,n}\\n?``): a character outside ``C`` (other than a newline), a newline before the
    end, or a run of ``C`` of the wrong length. The general complement on automata writes a
    counter of ``n`` states out, past its bounds for ``[0-9a-f]{24}``. Raises :class:`_Inexpressible`."""
    import re
    m = re.fullmatch(r"\^(.+)\{(\d+)(,(\d*))?\}\$", pattern, re.S)
    if m is None or not _one_char_atom(m.group(1)):
        raise _Inexpressible("pattern")
    atom, lo = m.group(1), int(m.group(2))
    hi = lo if m.group(3) is None else int(m.group(4)) if m.group(4) else None
    if hi is not None and hi < lo:
        raise _Inexpressible("pattern")
    try:
        widest = _union_ranges(_char_ranges(atom, 0), _char_ranges(atom, re.ASCII))
    except re.error:
        raise _Inexpressible("pattern") from None
    if any(a <= 10 <= b for a, b in widest):
        raise _Inexpressible("pattern")
    cls, outside = _class_of(widest), _complement_ranges(_union_ranges(widest, [(10, 10)]))
    if len(cls) > MAX_CLASS or len(_class_of(outside)) > MAX_CLASS:
        raise _Inexpressible("pattern")
    out = ["^(?s:.)*\\n(?s:.)+$"]
    if outside:
        out.append(f"^(?s:.)*{_class_of(outside)}(?s:.)*$")
    if lo > 0:
        out.append(f"^{cls}{{0,{lo - 1}}}\\n?$")
    if hi is not None:
        out.append(f"^{cls}{{{hi + 1},}}\\n?$")
    return out


def _complement_shape(pattern: str) -> str | None:
    """An anchored regex (None: no string) matching only strings that ``pattern`` (searched, as JSON Schema reads
    it) does not match, for two shapes: one character atom ``C`` (a class, an escape, ``.``;
    in a group or not), unanchored: the strings with no character in ``C``; ``^C+$`` / ``^C*$``
    where ``C`` holds a newline (Python's ``$`` also matches before a final newline): the strings
    with a character outside ``C`` (and, for ``+``, the empty string). Where the regex dialects
    disagree on ``C`` (Python's Unicode ``\\s`` / ``\\d`` / ``\\w`` against ECMA-262's ASCII ones) the
    widest reading counts as ``C``: sound under each, rejecting only strings whose characters
    outside ``C`` are ones they disagree on. Raises :class:`_Inexpressible` otherwise."""
    import re
    words = _anchored_literals(pattern)
    if words is not None:   # Python's $ also matches before a final newline: "x\n" matches ^x$
        return _not_one_of_pattern(words + [w + "\n" for w in words])
    p = pattern
    anchored = p.startswith("^") and p.endswith("$") and not p.endswith("\\$") and p[-2:-1] in ("+", "*")
    if anchored:
        p, repeat = p[1:-2], p[-2]
    while p.startswith("(") and _atom_end(p, 0) == len(p) and not p.startswith("(?"):
        p = p[1:-1]   # a capturing group around the atom
    if not _one_char_atom(p):
        raise _Inexpressible("pattern")
    try:
        unicode, ascii_ = _char_ranges(p, 0), _char_ranges(p, re.ASCII)
    except re.error:
        raise _Inexpressible("pattern") from None
    widest = _union_ranges(unicode, ascii_)
    if anchored and not all(any(a <= 10 <= b for a, b in r) for r in (unicode, ascii_)):
        raise _Inexpressible("pattern")   # "x\n" matches ^x+$ in Python (its $), not in ECMA-262
    outside = _complement_ranges(widest)
    cls = _class_of(outside) if outside else None
    if cls is not None and len(cls) > MAX_CLASS:
        raise _Inexpressible("pattern")
    if not anchored:
        return f"^{cls}*$" if cls else "^$"
    if cls is None:
        return "^$" if repeat == "+" else None
    return f"^(|(?s:.)*{cls}(?s:.)*)$" if repeat == "+" else f"^(?s:.)*{cls}(?s:.)*$"


def _atom_end(p: str, i: int) -> int:
    from replicas.grammar import _atom_end as end
    return end(p, i)


def _product_size(lists: list) -> int:
    n = 1
    for x in lists:
        n *= len(x)
        if n > MAX_ALTERNATIVES:
            break
    return n


def _negate_apart(b: list, ctx: list, root: Any, apart: set, kinds: set) -> list:
    """:func:`negate`, knowing that no instance of ``ctx`` of the kinds ``apart`` satisfies
    ``b``: those instances are written as their type, the rest negated keyword by keyword
    (where the kinds can be named: ``number`` without ``integer`` cannot)."""
    try:
        typed = [_type_schema(apart), _type_schema(kinds - apart)] if apart else None
    except _Inexpressible:
        typed = None
    if typed is None:
        return negate(b, ctx, root)
    return [typed[0], *negate(b, ctx + [typed[1]], root)]


def _negate_member(b: list, ctx: list, root: Any, apart: set, kinds: set) -> list:
    """:func:`_negate_apart`, narrowed as :attr:`_Narrowing.mode` says (module doc, "Narrowing").
    Raises :class:`_Inexpressible` where a narrowed negation would leave nothing (the branch
    would be dropped whole)."""
    if _narrowing.sink is None or _narrowing.mode == "exact":
        return _unique(_negate_apart(b, ctx, root, apart, kinds))
    if _narrowing.mode == "required":
        try:
            return _negate_by_required(b, ctx, root, apart, kinds)
        except _Inexpressible:
            pass
    mark = len(_narrowing.sink)
    alts = _unique(_negate_apart(b, ctx, root, apart, kinds))
    if not alts and len(_narrowing.sink) > mark:
        raise _Inexpressible("every way to fail another member left out")
    return alts


def _negate_by_required(b: list, ctx: list, root: Any, apart: set, kinds: set) -> list:
    """Narrowing: instances of ``ctx`` that fail ``b`` written as the kinds ``apart`` and the
    objects that lack a name ``b`` requires and ``ctx`` does not (a subset of those that fail:
    an object with every such name, one of them invalid, is left out)."""
    ib, ci = _info(b, root), _info(ctx, root)
    if ib is None or ci is None or "object" not in kinds:
        raise _Inexpressible("a member without required names")
    names = sorted(r for r in ib.required if r not in ci.required)
    if not names:
        raise _Inexpressible("a member without required names")
    _narrow(f"required: an object fails another member only where it lacks a name that member requires "
            f"({', '.join(names)})")
    try:
        typed = [_type_schema(apart)] if apart else []
    except _Inexpressible:
        typed = []
    return typed + [{"type": "object", "properties": {r: False}} for r in names]


def rewrite_one_of(node: dict, root: Any, narrowed: list | None = None, mode: str = "exact") -> bool:
    """Replace ``node``'s ``oneOf`` by an exact ``anyOf`` (module doc), in place; False (node
    unchanged) where a member's negation cannot be written exactly. With a list ``narrowed``,
    narrowing is allowed (module doc) and what was narrowed is appended to it (one line each,
    without repeats); ``mode`` ("exact", "partial" or "required") says how far a member's negation
    may be narrowed beyond that (module doc, "Narrowing")."""
    _narrowing.sink = [] if narrowed is not None else None
    _narrowing.mode = mode
    try:
        done = _rewrite_one_of(node, root)
        if done and narrowed is not None:
            narrowed += [w for w in dict.fromkeys(_narrowing.sink) if w not in narrowed]
        return done
    finally:
        _narrowing.sink, _narrowing.mode = None, "exact"


def _rewrite_one_of(node: dict, root: Any) -> bool:
    members = node.get("oneOf")
    if not isinstance(members, list) or not members:
        return False
    parent = {k: v for k, v in node.items() if k != "oneOf"}
    try:
        base = facets(parent, root)
        fs = [facets(m, root) for m in members]
    except UnresolvedRef:
        return False
    branches = []
    for i, m in enumerate(members):
        ctx = base + fs[i]
        negs = []
        try:
            kinds = getattr(_info(ctx, root), "kinds", _KINDS)
            for j in range(len(members)):
                if j == i:
                    continue
                apart = disjoint_kinds(ctx, base + fs[j], root) & kinds
                if apart >= kinds:
                    continue
                alts = _negate_member(fs[j], ctx, root, apart, kinds)
                if not alts:
                    negs = None   # m implies members[j]: no instance matches m alone
                    break
                negs.append(alts)
        except _Inexpressible:
            return False
        if negs is None:
            continue
        negs = _conjunction(negs)
        branches.append({"allOf": [m, *negs]} if negs else m)
    if len(json.dumps(branches)) > MAX_REWRITE_CHARS:
        return False   # negations multiplied past what llguidance compiles in its bounds
    del node["oneOf"]
    branches = branches or [False]
    if "anyOf" in node:
        node["allOf"] = (node["allOf"] if isinstance(node.get("allOf"), list) else []) + [{"anyOf": branches}]
    else:
        node["anyOf"] = branches
    return True
