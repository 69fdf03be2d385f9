"""Soundness on the JSONSchemaBench schemas that the ``not`` / ``if`` / ``uniqueItems`` /
``propertyNames`` rewrites newly serve.

    python -m bench.grammar_rewrites [--limit N] [--schema-s S] [--json OUT]

Which schemas: those using one of these keywords (``unenforced_keywords`` or, for
``propertyNames``, ``incomplete_keywords``) that llguidance refuses without the rewrites
(``replicas.schema_not.rewrite_all`` disabled; the ``oneOf`` rewrite kept) and compiles with them.
Each is checked as ``bench.grammar_newly_served`` describes, the loosened schema being the schema
with those keywords removed.
"""

from __future__ import annotations

import copy
import sys

KEYWORDS = ("not", "if", "then", "else", "uniqueItems", "propertyNames")


def uses_rewritten(schema) -> bool:
    from replicas import grammar as g
    places = g.unenforced_keywords(schema) + g.incomplete_keywords(schema)
    return any(p.split(" ", 1)[0] in KEYWORDS for p in places)


def newly_served(tok) -> list:
    from bench.grammar_newly_served import newly_served as find
    from replicas import schema_not
    return find(tok, uses_rewritten, schema_not, "rewrite_all", lambda *a, **k: None)


def relaxed(schema):
    """``schema`` without the rewritten keywords (instances drawn from it often break them)."""
    from replicas.grammar import _walk
    schema = copy.deepcopy(schema)
    for node, _ in _walk(schema):
        for k in KEYWORDS:
            node.pop(k, None)
    return schema


def main(argv: list[str] | None = None) -> int:
    from bench.grammar_newly_served import main as run
    return run(argv, "python -m bench.grammar_rewrites", __doc__, newly_served, relaxed, 8, "relaxed")


if __name__ == "__main__":
    sys.exit(main())
