"""Soundness on the JSONSchemaBench schemas that the ``not`` / ``if`` / ``uniqueItems`` /
``propertyNames`` rewrites newly serve.

    python -m bench.grammar_rewrites [--limit N] [--schema-s S] [--json OUT]

Which schemas: those using one of these keywords (``unenforced_keywords`` or, for
``propertyNames``, ``incomplete_keywords``) that llguidance refuses without the rewrites
(``replicas.schema_not.rewrite_all`` disabled; the ``oneOf`` rewrite kept) and compiles with them
(both in this process). Per schema, served through ``GrammarCompiler.compile``:
``bench.grammar_soundness.check_schema`` (hypothesis-jsonschema instances, their mutations,
grammar samples), plus instances drawn from the schema with those keywords removed (so many
break them), split by ``jsonschema``'s verdict on the real schema: the valid ones must be
accepted, the others rejected.
"""

from __future__ import annotations

import argparse
import collections
import copy
import gzip
import json
import random
import signal
import sys
from pathlib import Path

KEYWORDS = ("not", "if", "then", "else", "uniqueItems", "propertyNames")


def uses_rewritten(schema) -> bool:
    from replicas import grammar as g
    places = g.unenforced_keywords(schema) + g.incomplete_keywords(schema)
    return any(p.split(" ", 1)[0] in KEYWORDS for p in places)


def newly_served(tok) -> list:
    from bench.grammar_coverage import JSONSCHEMABENCH_DIR
    from replicas import grammar as g
    from replicas import schema_not
    from replicas.errors import GrammarCompileError
    llg = g._llguidance_tokenizer(tok, len(tok), [tok.eos_token_id])
    real = schema_not.rewrite_all

    def compiles(schema, rewrite: bool) -> bool:
        schema_not.rewrite_all = real if rewrite else (lambda *a, **k: None)
        try:
            g._llguidance_compile(*llg, g.GrammarSpec("json_schema", schema))
            return True
        except GrammarCompileError:
            return False
        finally:
            schema_not.rewrite_all = real
    out = []
    for path in sorted(JSONSCHEMABENCH_DIR.glob("*.jsonl.gz")):
        with gzip.open(path, "rt") as f:
            for i, line in enumerate(f):
                row = json.loads(line)
                schema = row.get("json_schema", row.get("schema", row))
                if isinstance(schema, str) or not uses_rewritten(schema):
                    continue
                if not compiles(schema, False) and compiles(schema, True):
                    out.append((path.name.split(".")[0], i, schema))
    return out


def relaxed(schema):
    """``schema`` without the rewritten keywords (instances drawn from it often break them)."""
    from replicas.grammar import _walk
    schema = copy.deepcopy(schema)
    for node, _ in _walk(schema):
        for k in KEYWORDS:
            node.pop(k, None)
    return schema


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.grammar_rewrites", description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, help="at most this many schemas (a seeded random sample)")
    ap.add_argument("--schema-s", type=float, default=6.0, help="CPU seconds per schema and check")
    ap.add_argument("--json", type=Path, help="one record per schema, JSON lines")
    args = ap.parse_args(argv)
    from bench import grammar_soundness as gs
    from bench.grammar_coverage import _compiler
    tok, compiler = _compiler(10.0)
    todo = newly_served(tok)
    print(f"newly served: {len(todo)}", file=sys.stderr)
    random.Random(0).shuffle(todo)
    tot = collections.Counter()
    out = args.json.open("w") if args.json else None
    for subset, i, schema in todo[:args.limit]:
        rec = gs.check_schema(compiler, tok, schema, schema_s=args.schema_s)
        extra = {}
        if rec["status"] in ("served", "bounded"):
            grammar, v = gs.Grammar(compiler, tok, schema), gs.validator(schema)
            gs._alarm(args.schema_s)
            try:
                xs, _ = gs.valid_instances(gs.typed(relaxed(schema)), 8, 1)
                extra = gs.check_instances(grammar, v, [x for x in xs if gs.is_valid(v, x) is True],
                                           [x for x in xs if gs.is_valid(v, x) is False], schema)
            except gs._Timeout:
                extra = {"bounded": 1}
            finally:
                signal.setitimer(signal.ITIMER_PROF, 0)
        tot["schemas"] += 1
        tot[rec["status"]] += 1
        for k in ("valid", "invalid", "valid_rejected", "invalid_accepted", "samples", "samples_invalid"):
            tot[k] += rec.get(k, 0)
        for k in ("valid", "invalid", "valid_rejected", "invalid_accepted"):
            tot["relaxed_" + k] += extra.get(k, 0)
        if out:
            out.write(json.dumps({"subset": subset, "i": i, "rec": rec, "relaxed": extra}, default=str) + "\n")
            out.flush()
        print(json.dumps({"subset": subset, "i": i, "status": rec["status"],
                          **{k: rec.get(k, 0) for k in ("invalid_accepted", "valid_rejected", "samples_invalid")},
                          "relaxed_invalid_accepted": extra.get("invalid_accepted", 0)}), file=sys.stderr)
    print(json.dumps(dict(tot)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
