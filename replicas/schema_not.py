"""``not`` and ``if`` / ``then`` / ``else`` in keywords llguidance enforces, exactly: llguidance
1.9 refuses both (and xgrammar drops them).

``{"not": B}`` inside a node ``P`` (the node's other keywords) holds for an instance of ``P``
exactly when it satisfies one of the schemas :func:`replicas.schema_oneof.negate` writes for
``B`` in the context of ``P`` (``not {required: [x]}`` is ``{type: object, properties: {x:
false}}`` or any non-object; ``not {enum: [...]}`` the other values of the type; ``not {type:
T}`` the other types; ``not {anyOf: [A, B]}`` the product of their negations; ``not {not: S}`` is
``S``; ``not {pattern: P}`` for ``P`` one character class, searched: strings of the complement
class only); it is replaced by ``anyOf`` of them (``anyOf: [false]`` where no instance of ``P``
can fail ``B``). ``{"if": I, "then": T, "else": E}`` is ``anyOf: [allOf: [I, T], allOf: [not I,
E]]`` with ``not I`` written the same way; ``if`` without ``then`` and ``else`` (and ``then`` /
``else`` without ``if``) constrains nothing and is dropped. Where a negation cannot be written
exactly the keyword stays, and llguidance refuses it (naming it and where).

Nodes are rewritten innermost first, and the whole pass repeated while it changes something, so
that a negation meets its subschemas already rewritten (also through a ``$ref``).
"""

from __future__ import annotations

from typing import Any

from replicas.schema_oneof import Inexpressible, UnresolvedRef, facets, negate

MAX_PASSES = 4
_IF_KEYWORDS = ("if", "then", "else")


def _add_any_of(node: dict, alternatives: list) -> None:
    """``node`` AND ``anyOf: alternatives`` (``[false]`` where there are none), in place."""
    alternatives = alternatives or [False]
    if "anyOf" not in node:
        node["anyOf"] = alternatives
    else:
        node["allOf"] = (node["allOf"] if isinstance(node.get("allOf"), list) else []) + [{"anyOf": alternatives}]


def _context(node: dict, root: Any, drop: tuple) -> list:
    return facets({k: v for k, v in node.items() if k not in drop}, root)


def rewrite_not(node: dict, root: Any) -> bool:
    """Replace ``node``'s ``not`` by the ``anyOf`` of its negations (module doc), in place;
    False (node unchanged) where they cannot be written exactly."""
    if "not" not in node:
        return False
    try:
        alternatives = negate(facets(node["not"], root), _context(node, root, ("not",)), root)
    except (Inexpressible, UnresolvedRef):
        return False
    del node["not"]
    _add_any_of(node, alternatives)
    return True


def rewrite_if(node: dict, root: Any) -> bool:
    """Replace ``node``'s ``if`` / ``then`` / ``else`` by an exact ``anyOf`` (module doc), in
    place; False (node unchanged) where ``not if`` cannot be written exactly."""
    if not any(k in node for k in _IF_KEYWORDS):
        return False
    cond, then, other = node.get("if", True), node.get("then", True), node.get("else", True)
    if "if" not in node or (then is True or then == {}) and (other is True or other == {}):
        for k in _IF_KEYWORDS:
            node.pop(k, None)     # nothing to apply: validators ignore it
        return True
    try:
        negations = negate(facets(cond, root), _context(node, root, _IF_KEYWORDS), root)
    except (Inexpressible, UnresolvedRef):
        return False
    for k in _IF_KEYWORDS:
        node.pop(k, None)
    branches = [cond if then is True or then == {} else {"allOf": [cond, then]}]
    if negations:
        if other is True or other == {}:
            branches += negations
        else:
            negated = negations[0] if len(negations) == 1 else {"anyOf": negations}
            branches.append({"allOf": [negated, other]})
    _add_any_of(node, branches)
    return True


_IF_MEMBER_KEYS = {"if", "then", "else", "title", "description", "$comment"}


def rewrite_if_chain(node: dict, root: Any) -> bool:
    """Replace the ``allOf`` members of ``node`` that are only ``if`` / ``then`` / ``else``
    (two or more) by one ``anyOf``, where their conditions are pairwise disjoint (a tag with a
    different ``const`` in each: JSONSchemaStore's v2ray, GitLab, ... configs), so at most one
    holds: ``anyOf: [allOf: [I1, T1, E2, E3, ...], allOf: [I2, T2, E1, E3, ...], ...,
    allOf: [not I1, not I2, ..., E1, E2, ...]]``. Written one by one (:func:`rewrite_if`) each
    would double the alternatives llguidance expands ("schema too large" past about ten).
    False (unchanged) where the conditions are not proved disjoint or not negated exactly."""
    members = node.get("allOf")
    if not isinstance(members, list):
        return False
    chain = [m for m in members if isinstance(m, dict) and "if" in m and set(m) <= _IF_MEMBER_KEYS]
    if len(chain) < 2:
        return False
    from replicas.schema_oneof import disjoint
    rest = [m for m in members if not any(m is c for c in chain)]
    try:
        ctx = _context(node, root, ("allOf",)) + [f for m in rest for f in facets(m, root)]
        conds = [ctx + facets(m["if"], root) for m in chain]
        if not all(disjoint(conds[i], conds[j], root) for i in range(len(chain)) for j in range(i)):
            return False
        negations = [negate(facets(m["if"], root), ctx, root) for m in chain]
    except (Inexpressible, UnresolvedRef):
        return False

    def given(s):
        return not (s is True or s == {})
    elses = [m.get("else", True) for m in chain]
    branches = []
    for i, m in enumerate(chain):
        parts = [m["if"], m.get("then", True)] + [e for j, e in enumerate(elses) if j != i]
        parts = [p for p in parts if given(p)]
        branches.append(parts[0] if len(parts) == 1 else {"allOf": parts} if parts else True)
    if all(negations):
        parts = [n[0] if len(n) == 1 else {"anyOf": n} for n in negations] + [e for e in elses if given(e)]
        branches.append(parts[0] if len(parts) == 1 else {"allOf": parts})
    node["allOf"] = rest + [{"anyOf": branches}]
    return True


def rewrite_all(schema: Any, walk, rewriters=(rewrite_if, rewrite_not), outer_first=(rewrite_if_chain,)) -> None:
    """Apply ``rewriters`` to every node of ``schema`` (``walk``: ``replicas.grammar._walk``),
    innermost first, after ``outer_first`` outermost first (a chain of ``if`` s is merged
    before its members are rewritten one by one), until a pass changes nothing (at most
    :data:`MAX_PASSES`)."""
    for _ in range(MAX_PASSES):
        changed = False
        for node, _ in list(walk(schema)):
            for rewrite in outer_first:
                changed |= rewrite(node, schema)
        for node, _ in reversed(list(walk(schema))):
            for rewrite in rewriters:
                changed |= rewrite(node, schema)
        if not changed:
            return
