"""``uniqueItems`` and ``propertyNames`` in keywords llguidance enforces, exactly, where they can
be: llguidance 1.9 refuses both (xgrammar drops ``uniqueItems`` and rejects valid keys under
``propertyNames``).

``uniqueItems: true`` constrains nothing with ``maxItems`` at most 1 (dropped; ``false`` always);
where an array's items come from a small finite set (``enum`` / ``const`` / ``boolean`` /
``null``, the values ``jsonschema`` accepts for ``items``) it is the ``anyOf`` of every array of
distinct values within ``minItems`` / ``maxItems`` (``const`` arrays; at most
:data:`MAX_ARRAYS`), beside any non-array the node allows. Elsewhere (strings, objects, ...) no
grammar can check uniqueness, and it stays refused.

``propertyNames`` (``true`` / ``{}`` / only ``type: string``: dropped):

- with a finite set of names (an ``enum`` / ``const``; the names ``jsonschema`` accepts for the
  whole ``propertyNames`` schema) the object is closed to them: each allowed name gets the
  schema its value must meet (its ``properties`` entry, the ``patternProperties`` it matches, or
  else ``additionalProperties``: ``allOf`` of those), every other declared property ``false``,
  ``patternProperties`` folded in and removed, ``additionalProperties: false``;
- with only a ``pattern`` P (and ``type: string``): declared properties whose names P does not
  match become ``false``, and the names not declared must match P: ``patternProperties: {P:
  S}`` with ``additionalProperties: false``, where ``S`` is the node's ``additionalProperties``
  (only where ``S`` is trivial or no declared name matches P, and the node has no
  ``patternProperties`` of its own: their names would escape P).

Under ``additionalProperties: false``, a ``patternProperties`` pattern that matches finitely many
names becomes those names' declared properties (:func:`rewrite_finite_pattern_properties`).

A name's match is decided here with Python's ``re`` (Unicode and ASCII alike, else refused).
"""

from __future__ import annotations

import itertools
import re
from typing import Any

from replicas.schema_not import _add_any_of
from replicas.schema_oneof import Inexpressible, Info, UnresolvedRef, _canon, _type_schema, facets

MAX_ARRAYS = 128     # distinct arrays written out for uniqueItems
MAX_NAMES = 1000     # names an object is closed to for propertyNames
_ANNOTATIONS = {"title", "description", "$comment", "examples", "default", "$id", "$schema", "deprecated",
                "readOnly", "writeOnly", "markdownDescription", "errorMessage"}


def _validator(root: Any):
    import warnings

    import jsonschema
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cls = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)
    return cls(root if isinstance(root, (dict, bool)) else {})


def _valid(root: Any, schema: Any, value: Any) -> bool:
    """Whether ``value`` satisfies ``schema`` (a node of ``root``; its ``$ref`` s resolved in it)."""
    return _validator(root).evolve(schema=schema).is_valid(value)


def _trivial(s: Any) -> bool:
    return s is True or (isinstance(s, dict) and not (set(s) - _ANNOTATIONS))


def _all_of(parts: list) -> Any:
    """One schema meaning every one of ``parts`` (the trivial ones left out; ``{}`` for none)."""
    parts = [p for p in parts if not _trivial(p)]
    return parts[0] if len(parts) == 1 else {"allOf": parts} if parts else {}


def _search(pattern: str, name: str) -> bool:
    """``re.search`` of ``pattern`` in ``name``, Unicode and ASCII alike (ValueError where they
    disagree or the pattern does not compile)."""
    try:
        u, a = re.search(pattern, name) is not None, re.search(pattern, name, re.ASCII) is not None
    except re.error:
        raise ValueError(pattern) from None
    if u != a:
        raise ValueError(pattern)
    return u


def rewrite_unique_items(node: dict, root: Any) -> bool:
    """Replace ``node``'s ``uniqueItems`` (module doc), in place; False (unchanged) where it
    cannot be written exactly."""
    if "uniqueItems" not in node:
        return False
    max_items, min_items = node.get("maxItems"), node.get("minItems", 0)
    if node["uniqueItems"] is not True or (isinstance(max_items, int) and not isinstance(max_items, bool)
                                           and max_items <= 1):
        del node["uniqueItems"]
        return True
    items = node.get("items", True)
    if any(k in node for k in ("prefixItems", "additionalItems", "contains")) or not isinstance(items, (dict, bool)):
        return False
    if not isinstance(min_items, int) or isinstance(min_items, bool):
        return False
    try:
        item = Info(facets(items, root), root)
        ctx = Info(facets({k: v for k, v in node.items() if k != "uniqueItems"}, root), root)
    except UnresolvedRef:
        return False
    if item.values is not None:
        values = list(item.values.values())
    elif item.kinds <= {"boolean", "null"}:
        values = ([True, False] if "boolean" in item.kinds else []) + ([None] if "null" in item.kinds else [])
    else:
        return False
    try:
        values = [v for v in values if _valid(root, items, v)]
    except Exception:   # a $ref jsonschema cannot resolve, ...
        return False
    values = list({_canon(v): v for v in values}.values())
    top = len(values) if not isinstance(max_items, int) else min(max_items, len(values))
    arrays = []
    for n in range(max(min_items, 0), top + 1):
        for arr in itertools.permutations(values, n):
            arrays.append({"const": list(arr)})
            if len(arrays) > MAX_ARRAYS:
                return False
    rest = ctx.kinds - {"array"}
    try:
        others = [_type_schema(rest)] if rest else []   # uniqueItems says nothing of non-arrays
    except Inexpressible:
        return False
    del node["uniqueItems"]
    _add_any_of(node, arrays + others)
    return True


def rewrite_property_names(node: dict, root: Any) -> bool:
    """Replace ``node``'s ``propertyNames`` (module doc), in place; False (unchanged) where it
    cannot be written exactly."""
    if "propertyNames" not in node:
        return False
    names_schema = node["propertyNames"]
    try:
        fs = facets(names_schema, root)
        info = Info(fs, root)
    except UnresolvedRef:
        return False
    keywords = {k for f in fs if isinstance(f, dict) for k in f} - _ANNOTATIONS
    only_string = all(isinstance(f, dict) and (f.get("type", "string") == "string" or
                                                isinstance(f.get("type"), list) and "string" in f["type"])
                      for f in fs if f is not True)
    props = node.get("properties", {})
    patterns = node.get("patternProperties", {})
    extra = node.get("additionalProperties", True)
    if not isinstance(props, dict) or not isinstance(patterns, dict):
        return False
    if only_string and keywords <= {"type"}:
        del node["propertyNames"]   # every name is a string
        return True
    try:
        if info.values is not None:
            names = [v for v in info.values.values() if isinstance(v, str) and _valid(root, names_schema, v)]
            if len(names) > MAX_NAMES:
                return False
            new = {}
            for name in names:
                parts = [props[name]] if name in props else []
                matched = [s for p, s in patterns.items() if _search(p, name)]
                parts += matched
                if name not in props and not matched:
                    parts.append(extra)
                new[name] = _all_of(parts)
            new.update({p: False for p in props if p not in new})
            node["properties"] = new
            node.pop("patternProperties", None)
            node["additionalProperties"] = False
            del node["propertyNames"]
            return True
        pats = [f["pattern"] for f in fs if isinstance(f, dict) and "pattern" in f]
        if not (only_string and keywords <= {"type", "pattern"} and len(pats) == 1 and isinstance(pats[0], str)):
            return False
        pattern = pats[0]
        if patterns:
            return False
        matching = [p for p in props if _search(pattern, p)]
        if not _trivial(extra) and matching:
            return False
    except ValueError:   # a pattern the dialects read differently
        return False
    node["properties"] = {p: (s if p in matching else False) for p, s in props.items()}
    if not node["properties"]:
        del node["properties"]
    node["patternProperties"] = {pattern: {} if _trivial(extra) else extra}
    node["additionalProperties"] = False
    del node["propertyNames"]
    return True


def _bare(s: Any) -> Any:
    """``s`` without its annotations (at the top: what a validator checks is the same)."""
    return {k: v for k, v in s.items() if k not in _ANNOTATIONS} if isinstance(s, dict) else s


_SIMPLE_PATTERN = re.compile(r"[\w^$*+?.()\[\]{}|,:-]*")   # no escapes: Python's and Rust's regexes agree


def drop_properties_patterns_cover(node: dict, root: Any) -> bool:
    """Drop a ``properties`` entry whose schema (its annotations aside) is that of a
    ``patternProperties`` pattern matching its name: the pattern's schema applies to it anyway,
    so the instances are the same; llguidance otherwise intersects the two, which it cannot do
    through a circular ``$ref`` ("circular references with sibling keys", WashingtonPost's ANS
    schemas: ``basic`` beside ``.*`` with the same ``oneOf`` of references). Only for patterns
    of plain characters, classes and repeats (read alike by Python's ``re`` and llguidance's)."""
    props, patterns = node.get("properties"), node.get("patternProperties")
    if not isinstance(props, dict) or not isinstance(patterns, dict) or not patterns:
        return False
    drop = []
    for name, s in props.items():
        if "\n" in name:
            continue
        for pattern, ps in patterns.items():
            try:
                if _SIMPLE_PATTERN.fullmatch(pattern) and _bare(ps) == _bare(s) and _search(pattern, name):
                    drop.append(name)
                    break
            except ValueError:
                continue
    for name in drop:
        del props[name]
    return bool(drop)


MAX_PATTERN_NAMES = 64   # names the finite patternProperties of one object are written out as


def rewrite_finite_pattern_properties(node: dict, root: Any) -> bool:
    """Under ``additionalProperties: false``, each ``patternProperties`` pattern that matches
    finitely many names (at most :data:`MAX_PATTERN_NAMES` for the object;
    :func:`replicas.regex_complement.finite_names`) written as those names' declared, optional
    ``properties``, in place: each with the ``allOf`` of its ``properties`` entry and the schemas
    of every pattern matching it (the instances are the same). The grammar then writes each name
    at most once by itself; left as a pattern, a name written twice is refused only at its closing
    quote (``replicas/name_checks.py``), where a closed object may allow nothing else: the output
    is cut mid-object (JSONSchemaBench Github_easy #1551, ``^line[1-3]$``, the model writing
    ``line3`` again). A name only some regex reading matches is not produced (module
    ``replicas.regex_complement``). False (unchanged) where no pattern is finite, or a remaining
    pattern's readings disagree on a written name."""
    from replicas.regex_complement import finite_names, search_in_every_reading
    patterns, props = node.get("patternProperties"), node.get("properties", {})
    if node.get("additionalProperties") is not False or not isinstance(patterns, dict) or not patterns \
            or not isinstance(props, dict):
        return False
    finite = {p: found for p in patterns if (found := finite_names(p, MAX_PATTERN_NAMES)) is not None}
    names = list(dict.fromkeys(n for found in finite.values() for n in found))
    if not finite or len(names) > MAX_PATTERN_NAMES:
        return False
    new = dict(props)
    for name in names:
        parts = [props[name]] if name in props else []
        for pattern, schema in patterns.items():
            hit = name in finite[pattern] if pattern in finite else search_in_every_reading(pattern, name)
            if hit is None:
                return False
            if hit:
                parts.append(schema)
        new[name] = _all_of(parts)
    node["properties"] = new
    node["patternProperties"] = {p: s for p, s in patterns.items() if p not in finite}
    if not node["patternProperties"]:
        del node["patternProperties"]
    return True
