"""Recursive ``$ref`` s that llguidance must intersect, written so that it can.

llguidance 1.9 compiles a ``$ref`` as a named rule, except where the reference has to be
*intersected* with something else: a ``$ref`` beside other keywords, or a member of an
``allOf`` (or of an ``anyOf`` / ``oneOf`` beside other keywords) that is a bare ``$ref``. There it
needs the target's compiled form, which does not exist yet while the target itself is being
compiled, and it refuses the schema ("circular references with sibling keys are not supported";
``json_schema/compiler.rs``, ``intersect_ref``). In JSONSchemaBench this refused the Washington
Post's ANS schemas (``content_json`` under a ``oneOf`` beside ``type``) and a dozen others.

:func:`inline_intersected_refs` replaces each such reference by a copy of what it points to
(one level: the copy's own references stay references), so that the intersection is between
two plain schemas and the recursion goes through named rules again. A reference beside other
keywords becomes one more ``allOf`` member, so no keyword moves away from the keywords it is read
with (``additionalProperties`` beside its ``properties``). Both are the same schema, so the
rewrite is exact. It is only tried where llguidance refused the schema for this reason
(:func:`replicas.grammar._llguidance_compile`).

:func:`drop_legacy_ref_siblings` is the other half, for drafts 3 to 7: there a ``$ref``'s siblings
are ignored (draft 7, section 8.3; ``jsonschema`` ignores them too), while llguidance reads them as
constraints to intersect.
"""

from __future__ import annotations

import copy
import json
from typing import Any

# Keywords that constrain nothing beside a ``$ref`` (annotations, and where definitions live).
_INERT = frozenset({"title", "description", "examples", "default", "$comment", "markdownDescription", "deprecated",
                    "readOnly", "writeOnly", "$schema", "definitions", "$defs"})
MAX_INLINED_CHARS = 2_000_000   # JSON characters copied in all (a bound on the schema's growth)


def _walk(schema: Any):
    from replicas.grammar import _walk as walk
    return [node for node, _ in walk(schema)]


def _has_nested_base(schema: Any) -> bool:
    """Whether a schema node below the root changes the base URI (``$id``, draft 4 ``id``): a
    ``#/...`` reference inside it may then name another document, so nothing is inlined."""
    return any(isinstance(n.get("$id"), str) or isinstance(n.get("id"), str) for n in _walk(schema) if n is not schema)


def drop_legacy_ref_siblings(schema: Any) -> int:
    """Remove, in place, every keyword beside a ``$ref`` but annotations (for a draft 3 to 7
    schema only: the caller decides). Returns how many nodes changed."""
    changed = 0
    for node in _walk(schema):
        if isinstance(node.get("$ref"), str) and set(node) - _INERT - {"$ref"}:
            for k in set(node) - _INERT - {"$ref"}:
                del node[k]
            changed += 1
    return changed


def inline_intersected_refs(schema: Any) -> int:
    """Replace, in place, the local ``$ref`` s llguidance would intersect (module doc) by a copy
    of their target (its ``definitions`` / ``$defs`` left out: references name them from the
    root). A ``{"$ref": R, ...siblings}`` node becomes ``{...siblings, "allOf": [copy of R, ...]}``;
    a bare ``{"$ref": R}`` member of a combinator becomes the copy. Returns how many references
    were inlined (0, ``schema`` unchanged, where a nested base URI or the size bound
    :data:`MAX_INLINED_CHARS` stops it)."""
    from replicas.schema_oneof import UnresolvedRef, resolve_pointer
    if not isinstance(schema, dict) or _has_nested_base(schema):
        return 0
    plan = []   # (node, target body)
    for node in _walk(schema):
        hits = []
        if isinstance(node.get("$ref"), str) and set(node) - _INERT - {"$ref"}:
            hits.append(node)
        for comb in ("allOf", "anyOf", "oneOf"):
            members = node.get(comb)
            if isinstance(members, list) and ((comb == "allOf" and len(members) > 1) or set(node) - _INERT - {comb}):
                hits += [m for m in members if isinstance(m, dict) and set(m) == {"$ref"} and isinstance(m["$ref"], str)]
        for ref_node in hits:
            target = ref_node["$ref"]
            try:
                for _ in range(32):   # a chain of bare references: its end
                    body = resolve_pointer(schema, target)
                    if not (isinstance(body, dict) and set(body) == {"$ref"} and isinstance(body["$ref"], str)):
                        break
                    target = body["$ref"]
            except UnresolvedRef:
                continue
            if isinstance(body, dict):
                plan.append((ref_node, {k: v for k, v in body.items() if k not in ("definitions", "$defs")}))
    if sum(len(json.dumps(body)) for _, body in plan) > MAX_INLINED_CHARS:
        return 0
    plan = [(ref_node, copy.deepcopy(body)) for ref_node, body in plan]   # (all copied before any change)
    for ref_node, body in plan:
        del ref_node["$ref"]
        if set(ref_node) - _INERT:   # siblings: the target is one more conjunct
            ref_node["allOf"] = [body] + (ref_node["allOf"] if isinstance(ref_node.get("allOf"), list) else [])
        else:
            ref_node.update(body)
    return len(plan)

