"""What ``bench.grammar_oneof`` and ``bench.grammar_rewrites`` share: find the JSONSchemaBench
schemas that one schema rewrite newly serves, and check each for soundness and completeness.

Per schema the rewrite newly serves (llguidance refuses it with the rewrite disabled and compiles
it with the rewrite, both in this process), served through ``GrammarCompiler.compile``:
``bench.grammar_soundness.check_schema`` (hypothesis-jsonschema instances, their mutations,
grammar samples), plus instances drawn from a *loosened* schema (the rewritten keywords weakened
or removed, so many instances break them), split by ``jsonschema``'s verdict on the real schema:
the valid ones must be accepted, the others rejected.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import random
import signal
import sys
from pathlib import Path
from typing import Callable


def newly_served(tok, flagged: Callable[[dict], bool], module, attr: str, disabled: Callable) -> list:
    """``(subset, index, schema)`` of every schema ``flagged`` selects that llguidance refuses with
    ``module.attr`` replaced by ``disabled`` and compiles with the real one."""
    from bench.grammar_coverage import JSONSCHEMABENCH_DIR
    from replicas import grammar as g
    from replicas.errors import GrammarCompileError
    llg = g._llguidance_tokenizer(tok, len(tok), [tok.eos_token_id])
    real = getattr(module, attr)

    def compiles(schema, rewrite: bool) -> bool:
        setattr(module, attr, real if rewrite else disabled)
        try:
            g._llguidance_compile(*llg, g.GrammarSpec("json_schema", schema))
            return True
        except GrammarCompileError:
            return False
        finally:
            setattr(module, attr, real)
    out = []
    for path in sorted(JSONSCHEMABENCH_DIR.glob("*.jsonl.gz")):
        with gzip.open(path, "rt") as f:
            for i, line in enumerate(f):
                row = json.loads(line)
                schema = row.get("json_schema", row.get("schema", row))
                if isinstance(schema, str) or not flagged(schema):
                    continue
                if not compiles(schema, False) and compiles(schema, True):
                    out.append((path.name.split(".")[0], i, schema))
    return out


def main(argv: list[str] | None, prog: str, doc: str, find: Callable, loosen: Callable[[dict], dict],
         num_loose: int, key: str) -> int:
    """The command line of one rewrite's check: ``find(tok)`` lists the newly served schemas,
    ``loosen(schema)`` is drawn from (``num_loose`` instances); per-schema records go to
    ``--json`` (JSON lines, the loosened instances' counts under ``key``) and the totals to stdout."""
    ap = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    ap.add_argument("--limit", type=int, help="at most this many schemas (a seeded random sample)")
    ap.add_argument("--schema-s", type=float, default=6.0, help="CPU seconds per schema and check")
    ap.add_argument("--json", type=Path, help="one record per schema, JSON lines")
    args = ap.parse_args(argv)
    from bench import grammar_soundness as gs
    from bench.grammar_coverage import _compiler
    tok, compiler = _compiler(10.0)
    todo = find(tok)
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
                xs, _ = gs.valid_instances(gs.typed(loosen(schema)), num_loose, 1)
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
            tot[f"{key}_{k}"] += extra.get(k, 0)
        if out:
            out.write(json.dumps({"subset": subset, "i": i, "rec": rec, key: extra}, default=str) + "\n")
            out.flush()
        print(json.dumps({"subset": subset, "i": i, "status": rec["status"],
                          **{k: rec.get(k, 0) for k in ("invalid_accepted", "valid_rejected", "samples_invalid")},
                          f"{key}_invalid_accepted": extra.get("invalid_accepted", 0)}), file=sys.stderr)
    print(json.dumps(dict(tot)))
    return 0
