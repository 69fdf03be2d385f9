"""Soundness on the JSONSchemaBench schemas the ``oneOf`` rewrite newly serves.

    python -m bench.grammar_oneof [--limit N] [--schema-s S] [--json OUT]

Which schemas: those whose ``oneOf`` our check flags (``oneOf with members that may overlap``)
that llguidance refuses without the rewrite (``replicas.schema_oneof.rewrite_one_of`` disabled)
and compiles with it. Each is checked as ``bench.grammar_newly_served`` describes, the loosened
schema being the schema with every ``oneOf`` read as ``anyOf`` (so some instances match two
members).
"""

from __future__ import annotations

import copy
import sys


def newly_served(tok) -> list:
    from bench.grammar_newly_served import newly_served as find
    from replicas import grammar as g
    from replicas import schema_oneof
    return find(tok, lambda s: any("oneOf with members" in p for p in g.unenforced_keywords(s)),
                schema_oneof, "rewrite_one_of", lambda node, root: False)


def as_any_of(schema):
    from replicas.grammar import _walk
    schema = copy.deepcopy(schema)
    for node, _ in _walk(schema):
        if isinstance(node.get("oneOf"), list) and "anyOf" not in node:
            node["anyOf"] = node.pop("oneOf")
    return schema


def main(argv: list[str] | None = None) -> int:
    from bench.grammar_newly_served import main as run
    return run(argv, "python -m bench.grammar_oneof", __doc__, newly_served, as_any_of, 6, "anyof")


if __name__ == "__main__":
    sys.exit(main())
