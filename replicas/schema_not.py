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


def rewrite_all(schema: Any, walk, rewriters=(rewrite_if, rewrite_not)) -> None:
    """Apply ``rewriters`` to every node of ``schema`` (``walk``: ``replicas.grammar._walk``),
    innermost first, until a pass changes nothing (at most :data:`MAX_PASSES`)."""
    for _ in range(MAX_PASSES):
        changed = False
        for node, _ in reversed(list(walk(schema))):
            for rewrite in rewriters:
                changed |= rewrite(node, schema)
        if not changed:
            return
