"""Soundness and completeness of the schema grammars on real schemas.

    python -m bench.grammar_soundness jsonschemabench [--subsets ...] [--limit N] [--checkpoint F]

For every JSONSchemaBench schema, through the server's path (``GrammarCompiler.compile``: the
backend ``replicas.grammar.backend_for`` picks, its fallback, or a refusal):

- valid instances: drawn with ``hypothesis-jsonschema`` (where it applies) and kept only if
  ``jsonschema`` (with its format checker) says they are valid; each must be accepted by the
  grammar (completeness) in one of the layouts below (one rejected that fails a format the server
  enforces in every draft, ``uuid`` under draft 7 say, is counted apart: :func:`stricter_validator`);
- invalid instances: mutations of the valid ones (a required key dropped, a value of the wrong
  type, a number out of range, an extra property, a string too long / too short, an enum value
  changed, an item added / dropped, ...), kept only if ``jsonschema`` says they are invalid; each
  must be rejected by the grammar in every layout, and also with every property name's first
  character written as a ``\\u`` escape (:func:`escaped_names`) (soundness); and each valid
  instance written with a name repeated in an object (:func:`repeated_names`) must be rejected
  too (counted with the invalid texts);
- grammar samples: texts the grammar itself produces (a seeded random walk over its token mask
  until EOS); each must parse and validate (soundness, without needing a generator).

A text is the JSON the model would write, tokenized with the embedded model's tokenizer and fed
token by token, then EOS. Layouts: keys in the schema's property order (the grammar writes
declared properties in that order) with the separators the grammar allows (``", "``, ``": "``),
the same compact, and the instance's own key order; floats also written without an exponent and
integral ones as integers, U+007F also escaped, an object or array listed in an ``enum`` / ``const``
written compact (as xgrammar writes such a literal); and, where those fail, keys in whatever order
the matcher takes them, floats also with trailing zeros (:meth:`Grammar.guided`: a depth-first
search over the whole text within a budget of pieces, which writes the text in pieces: the same
bytes, other token boundaries). A text counts as it parses (``-8`` for ``-8.0``). The property
order is that of :func:`schema_order`: llguidance's (the schema text's keyword order, the union
members the instance fits).

Each schema runs in one worker process (one at a time: CPU is shared), bounded by ``--schema-s``
seconds of CPU time for generation and matching and ``--timeout-s`` for each compile; per-schema records go
to a checkpoint (JSONL) so a stopped run resumes where it was. ``--before-ref`` (a git ref) also
checks the same instances with the backend that ref's rule picks, where it differs (the counts
before a routing change, measured in the same run). ``--recheck-moved`` runs again the schemas
whose backend the code now picks differently, ``--recheck-failing`` those with a failure (after a
fix); a schema's last record counts.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gzip
import json
import math
import multiprocessing as mp
import random
import signal
import sys
import time
from pathlib import Path

from bench.grammar_coverage import JSONSCHEMABENCH_DIR, _before_check
from replicas.schema_oneof import UnresolvedRef, resolve_pointer

N_VALID, N_INVALID, N_SAMPLES = 3, 6, 1
# pieces (keys, values, separators) :meth:`Grammar.guided` writes at most beyond writing the instance
# once, for a valid instance, and for an invalid one (where it only looks for a key order that lets
# an invalid value through; about 0.3 ms a piece with the server's matcher)
GUIDED_BUDGET, GUIDED_BUDGET_INVALID = 2000, 200


# ---------------------------------------------------------------------------------- instances
def _hypothesis_jsonschema_compat() -> None:
    """hypothesis-jsonschema 0.23.1 calls ``many.more()``, which hypothesis >= 6.15x replaced by
    ``with many(...) as e: for _ in e:``; give its module a ``many`` with ``more()`` on top."""
    import hypothesis.internal.conjecture.utils as cu
    import hypothesis_jsonschema._from_schema as fs
    if hasattr(cu.many, "more") or getattr(fs, "_compat", False):
        return

    class _Many:
        def __init__(self, data, **kw):
            self._m = cu.many(data, **kw)
            self._m.__enter__()
            self._it = iter(self._m)

        def more(self) -> bool:
            if next(self._it, StopIteration) is StopIteration:
                self._m.__exit__(None, None, None)
                return False
            return True

        def reject(self, why=None):
            self._m.reject(why)

    class _CU:
        def __getattr__(self, name):
            return _Many if name == "many" else getattr(cu, name)
    fs.cu, fs._compat = _CU(), True


def _ecma_end(pattern: str) -> str:
    """``pattern`` with every ``$`` outside a class written ``\\Z``: ECMA-262's ``$`` (without the
    multiline flag) matches only at the end of the input, Python's also before a final newline
    (``^[a-z]+$`` took ``"abc\\n"``)."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = ch != "]" or (out and out[-1] in ("[", "[^"))
        elif ch == "[":
            in_class = True
            if pattern.startswith("[^", i):
                out.append("[^")
                i += 2
                continue
        elif ch == "$":
            ch = "\\Z"
        out.append(ch)
        i += 1
    return "".join(out)


def _ecma(pattern: str) -> str:
    """``pattern`` for Python's ``re`` with ``re.ASCII`` as ECMA-262 reads it: ``\\w``, ``\\d``,
    ``\\b`` ASCII-only (the flag), ``\\s`` ECMA's WhiteSpace and LineTerminator (which add
    U+00A0, U+FEFF, U+2028 ... to ASCII's), ``$`` at the very end only (:func:`_ecma_end`)."""
    from replicas.grammar import ecma_whitespace
    try:
        pattern = ecma_whitespace(pattern)
    except ValueError:   # \S in a class: ASCII's reading
        pass
    return _ecma_end(pattern)


def _ecma_pattern(validator, pattern, instance, schema):
    """``pattern`` as ECMA-262 (which JSON Schema names) reads it (:func:`_ecma`); Python's ``re``
    makes ``\\w`` / ``\\d`` Unicode-aware (``\\w`` matched ``"ŭ"``)."""
    import re

    from jsonschema.exceptions import ValidationError
    if validator.is_type(instance, "string") and not re.search(_ecma(pattern), instance, re.ASCII):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _ecma_pattern_properties(validator, patterns, instance, schema):
    """``patternProperties`` with ECMA-262's ASCII classes, as :func:`_ecma_pattern`."""
    import re
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for k, v in instance.items():
            if re.search(_ecma(pattern), k, re.ASCII):
                yield from validator.descend(v, subschema, path=k, schema_path=pattern)


def _ecma_additional_properties(validator, additional, instance, schema):
    """``additionalProperties`` with the keys ``patternProperties`` match read as ECMA-262 does
    (:func:`_ecma`); ``jsonschema``'s own reads them with Python's Unicode ``\\d`` (a key of
    Unicode digits counted as matching ``^[A-Fa-f\\d]{24}$``, so it was not additional)."""
    import re

    from jsonschema.exceptions import ValidationError
    if not validator.is_type(instance, "object"):
        return
    props, patterns = schema.get("properties", {}), [_ecma(p) for p in schema.get("patternProperties", {})]
    extras = [k for k in instance if k not in props and not any(re.search(p, k, re.ASCII) for p in patterns)]
    if validator.is_type(additional, "object"):
        for k in extras:
            yield from validator.descend(instance[k], additional, path=k)
    elif not additional and extras:
        yield ValidationError(f"additional properties {extras[:4]!r} are not allowed")


def _decimal_multiple_of(validator, divisor, instance, schema):
    """``multipleOf`` in decimal, as the JSON text reads (``4.35`` is 435 x ``0.01``; in binary
    floating point, as ``jsonschema`` divides, it is not)."""
    from decimal import Decimal, InvalidOperation

    from jsonschema.exceptions import ValidationError
    if not validator.is_type(instance, "number") or not validator.is_type(divisor, "number") or not divisor:
        return
    try:
        q = Decimal(repr(instance)) / Decimal(repr(divisor))
        ok = q == q.to_integral_value()
    except (InvalidOperation, ValueError, OverflowError):
        ok = True   # inf / nan: not JSON
    if not ok:
        yield ValidationError(f"{instance!r} is not a multiple of {divisor!r}")


def validator(schema):
    """A ``jsonschema`` validator for ``schema`` (its ``$schema`` draft, else 2020-12) that checks
    formats, with ECMA-262's ASCII ``\\w`` / ``\\d`` in ``pattern``, ``patternProperties`` and the
    keys ``additionalProperties`` counts, and a decimal ``multipleOf``."""
    import jsonschema
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    cls = jsonschema.validators.extend(cls, {"pattern": _ecma_pattern, "patternProperties": _ecma_pattern_properties,
                                             "additionalProperties": _ecma_additional_properties,
                                             "multipleOf": _decimal_multiple_of})
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def stricter_validator(schema):
    """:func:`validator` with the formats the server enforces in every draft also checked where
    the schema's draft leaves them unchecked (``uuid`` under draft 4 to 7, ``date`` under draft
    4: ``replicas.grammar._LLG_FORMATS``, kept on purpose, stricter than the draft, as users
    expect), or None where the draft already checks them all. A valid instance the grammar rejects
    that fails this one is counted apart (``valid_rejected_format``): a choice, not a defect."""
    import jsonschema

    from replicas.grammar import _LLG_FORMATS
    v = validator(schema)
    have = set(v.format_checker.checkers)
    extra = (_LLG_FORMATS & set(jsonschema.FormatChecker.checkers)) - have
    if not extra:
        return None
    return type(v)(schema, format_checker=jsonschema.FormatChecker(formats=have | extra))


def is_valid(v, instance) -> bool | None:
    """Whether ``instance`` validates; None where the validator itself fails (a bad ``$ref``,
    a pattern Python's ``re`` cannot compile, ...)."""
    try:
        return v.is_valid(instance)
    except Exception:  # jsonschema raises many kinds on malformed schemas
        return None


_IMPLIED = {"object": ("properties", "required", "additionalProperties", "patternProperties", "minProperties",
                       "maxProperties"),
            "array": ("items", "prefixItems", "minItems", "maxItems", "additionalItems"),
            "string": ("minLength", "maxLength", "pattern", "format"),
            "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")}


def typed(schema):
    """A copy of ``schema`` where a node without ``type`` whose keywords all belong to one type
    (``properties`` -> object, ``maxLength`` -> string, ...) gets that type: the instances drawn
    from it are the ones the schema is written for (both backends narrow such a node to that type;
    other values, e.g. ``null`` for ``{"properties": ...}``, are valid by the letter and rejected
    by xgrammar, a restriction counted apart from this benchmark)."""
    import copy

    from replicas.grammar import _walk
    schema = copy.deepcopy(schema)
    for node, _ in _walk(schema):
        if "type" in node or "enum" in node or "const" in node:
            continue
        kinds = [t for t, kws in _IMPLIED.items() if any(k in node for k in kws)]
        if len(kinds) == 1:
            node["type"] = kinds[0]
    return schema


def valid_instances(schema, n: int, seed: int = 0) -> tuple[list, str]:
    """Up to ``n`` distinct instances of ``schema`` drawn by hypothesis-jsonschema, and "" or why
    it does not apply (it raised on the schema, or drew nothing)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis_jsonschema import from_schema
    _hypothesis_jsonschema_compat()
    out, seen = [], set()
    try:
        strategy = from_schema(schema)

        @settings(max_examples=n + 2, database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck), derandomize=True)
        @given(strategy)
        def draw(x):
            key = json.dumps(x, sort_keys=True)
            if key not in seen and len(out) < n:
                seen.add(key)
                out.append(x)
        draw()
    except _Timeout:
        raise
    except Exception as e:  # InvalidArgument, Unsatisfiable, RecursionError, its own bugs
        if not out:
            return [], f"{type(e).__name__}: {str(e)[:120]}"
    return out, "" if out else "drew nothing"


def _paths(x, path=()):
    yield path, x
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _paths(v, path + (k,))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _paths(v, path + (i,))


def _replace(x, path, new):
    if not path:
        return new
    import copy
    x = copy.deepcopy(x)
    parent = x
    for p in path[:-1]:
        parent = parent[p]
    if new is _DROP:
        del parent[path[-1]]
    else:
        parent[path[-1]] = new
    return x


_DROP = object()


def mutations(x) -> list:
    """Candidate invalid instances made from ``x`` (most will be checked invalid by jsonschema
    before use): at every node, a key dropped / an extra key / an item dropped or repeated / a
    value of another type / a number moved out of range or off its multiple / a string made
    longer, shorter, or another enum-like value."""
    out = []
    for path, v in _paths(x):
        if path:
            out.append(_replace(x, path, _DROP))
        if isinstance(v, dict):
            out.append(_replace(x, path, {**v, "zz_extra": 1}))
            out.append(_replace(x, path, []))
        elif isinstance(v, list):
            out += [_replace(x, path, v + v[-1:]), _replace(x, path, v + [None]), _replace(x, path, {})]
            out += [_replace(x, path, v + v)] if v else []
        elif isinstance(v, bool) or v is None:
            out += [_replace(x, path, 0), _replace(x, path, "x")]
        elif isinstance(v, (int, float)):
            out += [_replace(x, path, w) for w in (str(v), v + 0.5, v * 10 + 10**6, -abs(v) - 10**6, v + 1, v - 1)]
        elif isinstance(v, str):
            out += [_replace(x, path, w) for w in (len(v), v + "_x", v + "x" * 300, v[:-1], "", v[:1].upper() + v[1:],
                                                   " " + v, v + "\n")]
    return out


def invalid_instances(v, valids: list, n: int, rng: random.Random) -> list:
    """Up to ``n`` distinct mutations of ``valids`` that ``v`` says are invalid."""
    cands = [m for x in valids for m in mutations(x)]
    rng.shuffle(cands)
    out, seen = [], set()
    for m in cands:
        key = json.dumps(m, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        if is_valid(v, m) is False:
            out.append(m)
            if len(out) >= n:
                break
    return out


# ---------------------------------------------------------------------------------- layouts
def _resolve(root, ref: str):
    """The node a local ``$ref`` names, or None: a JSON pointer
    (``replicas.schema_oneof.resolve_pointer``) or a plain-name fragment (``#name``: the node whose
    ``id`` / ``$id`` is ``#name``, as draft 4 to 7 name them, or whose ``$anchor`` is ``name``)."""
    try:
        return resolve_pointer(root, ref)
    except UnresolvedRef:
        pass
    if not ref.startswith("#") or ref.startswith("#/"):
        return None
    stack = [root]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            if ref in (n.get("id"), n.get("$id")) or n.get("$anchor") == ref[1:]:
                return n
            stack.extend(n.values())
        elif isinstance(n, list):
            stack.extend(n)
    return None


def _expand(nodes, root, x=None, v=None):
    """``nodes`` and every schema they stand for at the same instance ($ref, allOf / anyOf /
    oneOf members, if / then / else), in the order llguidance merges their ``properties``: the
    order the schema's text lists the keywords in (an ``allOf`` or ``$ref`` written before
    ``properties`` puts its names first: JSONSchemaBench Github_medium #1854; after it, last).
    With instance ``x`` and ``v`` (:func:`validator` of ``root``), only the ``anyOf`` / ``oneOf``
    members ``x`` validates against (all where it fits none): the member the grammar writes it
    by (JsonSchemaStore #63: a ``cssBundle``'s ``minify`` names, not a ``jsBundle``'s first)."""
    out, seen = [], set()

    def visit(n):
        if not isinstance(n, dict) or id(n) in seen:
            return
        seen.add(id(n))
        if "properties" not in n:
            out.append(n)
        for k in n:
            if k == "properties":
                out.append(n)
            elif k == "$ref" and isinstance(n[k], str):
                visit(_resolve(root, n[k]))
            elif k in ("allOf", "anyOf", "oneOf") and isinstance(n[k], list):
                members = n[k]
                if k != "allOf" and v is not None and len(members) > 1:
                    members = [m for m in members if is_valid(v.evolve(schema=m), x)] or members
                for m in members:
                    visit(m)
        for k in ("then", "else"):
            visit(n.get(k))

    for n in nodes:
        visit(n)
    return out


def schema_order(x, schema, root=None, v=None):
    """``x`` with each object's keys in the order its schema declares them (declared first, in
    ``properties`` order across the schemas that apply (:func:`_expand`: of a union, the members
    ``x`` fits), then names ``required`` but not declared, in ``required`` order, as llguidance
    writes them, then the others as they were): the order the grammars write properties in."""
    import re
    if root is None:
        root = schema
        try:
            v = validator(root)
        except Exception:   # a schema jsonschema cannot read: every member, as written
            v = None
    nodes = _expand([schema], root, x, v)
    if isinstance(x, dict):
        order = []
        for n in nodes:
            props = n.get("properties")
            if isinstance(props, dict):
                order += [k for k in props if k in x and k not in order]
        for n in nodes:
            if isinstance(n.get("required"), list):
                order += [k for k in n["required"] if isinstance(k, str) and k in x and k not in order]
        order += [k for k in x if k not in order]
        out = {}
        for k in order:
            subs = [n["properties"][k] for n in nodes if isinstance(n.get("properties"), dict) and k in n["properties"]]
            for n in nodes:
                for p, s in (n.get("patternProperties") or {}).items() if isinstance(n.get("patternProperties"), dict) else ():
                    try:
                        if re.search(p, k):
                            subs.append(s)
                    except re.error:
                        pass
                if not subs and isinstance(n.get("additionalProperties"), dict):
                    subs.append(n["additionalProperties"])
            out[k] = schema_order(x[k], {"allOf": subs} if subs else {}, root, v)
        return out
    if isinstance(x, list):
        items = []
        for i, item in enumerate(x):
            subs = []
            for n in nodes:
                prefix = n.get("prefixItems") or (n.get("items") if isinstance(n.get("items"), list) else None)
                if isinstance(prefix, list) and i < len(prefix):
                    subs.append(prefix[i])
                elif isinstance(n.get("items"), dict):
                    subs.append(n["items"])
                elif isinstance(n.get("additionalItems"), dict):
                    subs.append(n["additionalItems"])
            items.append(schema_order(item, {"allOf": subs} if subs else {}, root, v))
        return items
    return x


def _plain_floats(x):
    """``x`` with floats that Python writes with an exponent replaced by their plain decimal,
    and integral floats below 2**53 written as integers (``-8.0`` as ``-8``: the same number to
    JSON Schema; llguidance writes a multiple of 0.25 without ``.0``: JSONSchemaBench
    Github_hard #659) (as a string marker, replaced after dumping)."""
    if isinstance(x, float) and math.isfinite(x) and x.is_integer() and abs(x) < 2 ** 53:
        return _Raw(str(int(x)))
    if isinstance(x, float) and math.isfinite(x) and "e" in repr(x):
        from decimal import Decimal
        return _Raw(format(Decimal(repr(x)), "f"))
    if isinstance(x, dict):
        return {k: _plain_floats(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_plain_floats(v) for v in x]
    return x


def _size(x) -> int:
    """Values in ``x`` (itself, every member and item, nested)."""
    if isinstance(x, dict):
        return 1 + sum(_size(v) for v in x.values())
    if isinstance(x, list):
        return 1 + sum(_size(v) for v in x)
    return 1


def _padded(x) -> list[str]:
    """A finite float written plain with 1 to 3 more trailing zeros (``2.5`` as ``2.50``: llguidance
    writes a multiple of 0.25 with exactly two decimals)."""
    if not isinstance(x, float) or not math.isfinite(x) or abs(x) >= 1e16:
        return []
    from decimal import Decimal
    plain = format(Decimal(repr(x)), "f")
    plain = plain if "." in plain else plain + "."
    return [plain + "0" * n for n in (1, 2, 3)]


class _Raw(str):
    pass


def _dumps(x, compact: bool) -> str:
    seps = (",", ":") if compact else (", ", ": ")
    raws = []

    def default(o):
        raise TypeError(o)

    def mark(v):
        if isinstance(v, _Raw):
            raws.append(str(v))
            return f"\x00{len(raws) - 1}\x00"
        if isinstance(v, dict):
            return {k: mark(w) for k, w in v.items()}
        if isinstance(v, list):
            return [mark(w) for w in v]
        return v
    text = json.dumps(mark(x), ensure_ascii=False, separators=seps, allow_nan=False, default=default)
    for i, r in enumerate(raws):
        text = text.replace(f'"\\u0000{i}\\u0000"', r)
    return text


def _literals(schema) -> list:
    """The objects and arrays the schema lists as ``enum`` members or ``const`` values, anywhere."""
    out, stack = [], [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            values = (node.get("enum") if isinstance(node.get("enum"), list) else []) + \
                ([node["const"]] if "const" in node else [])
            out += [v for v in values if isinstance(v, (dict, list))]
            stack += [v for k, v in node.items() if k not in ("enum", "const")]
        elif isinstance(node, list):
            stack += node
    return out


def _compact_literals(x, literals: dict):
    """``x`` with each object or array equal to one of ``literals`` (by
    :func:`replicas.schema_oneof._canon`, JSON Schema's equality) replaced by that literal written
    compact (a raw marker): xgrammar writes an ``enum`` / ``const`` object as ``{"b":1}`` inside
    text whose other separators are ``", "`` / ``": "``."""
    from replicas.schema_oneof import _canon
    if isinstance(x, (dict, list)) and _canon(x) in literals:
        return _Raw(json.dumps(literals[_canon(x)], ensure_ascii=False, separators=(",", ":")))
    if isinstance(x, dict):
        return {k: _compact_literals(v, literals) for k, v in x.items()}
    if isinstance(x, list):
        return [_compact_literals(v, literals) for v in x]
    return x


def layouts(x, schema) -> list[str]:
    """The texts tried for instance ``x`` (distinct; see the module docstring)."""
    ordered = schema_order(x, schema)
    texts = []
    for y in (ordered, x):
        for compact in (False, True):
            texts.append(_dumps(y, compact))
        plain = _plain_floats(y)
        if plain != y:
            texts.append(_dumps(plain, False))
    texts += [t.replace("\x7f", "\\u007f") for t in texts[:1] if "\x7f" in t]   # DEL escaped (llguidance)
    literals = _literals(schema)
    if literals:
        from replicas.schema_oneof import _canon
        texts.append(_dumps(_compact_literals(ordered, {_canon(v): v for v in literals}), False))
    return list(dict.fromkeys(texts))


# ---------------------------------------------------------------------------------- the grammar
class Grammar:
    """One schema's grammar as the server compiles it (or, with ``backend``, with that backend):
    ``accepts(text)`` feeds the text's tokens then EOS to a fresh matcher; ``sample(rng)`` walks
    the token mask at random until EOS."""

    def __init__(self, compiler, tok, schema, backend: str | None = None):
        from replicas.grammar import GrammarSpec, LLGuidanceGrammar, LLGuidanceMatcher, XGrammarMatcher, _check
        self.compiler, self.tok = compiler, tok
        self.spec = _check(GrammarSpec("json_schema", schema))
        compiled = compiler.compile(self.spec) if backend is None else compiler._compile_in_thread(backend, self.spec)
        self.backend = "llguidance" if isinstance(compiled, LLGuidanceGrammar) else "xgrammar"
        cls = LLGuidanceMatcher if self.backend == "llguidance" else XGrammarMatcher
        # the server's matcher (with the checks it adds: replicas/decode_checks.py, name_checks.py),
        # or the backend's own
        self.new = (lambda: compiler.matcher(self.spec)) if backend is None else (lambda: cls(compiled))
        self.eos = compiler.info.stop_token_ids[0]

    def _ids(self, text: str) -> list[int]:
        """``text``'s token ids as characters: special tokens split (as ``split_special_tokens``)
        and also the added ones (``<tools>``, ``<tool_call>``: llguidance counts those as special
        and keeps them out of JSON strings, where the model spells them in pieces)."""
        import re
        if not hasattr(self, "_added"):
            added = sorted((t.content for t in self.tok.added_tokens_decoder.values() if len(t.content) > 1),
                           key=len, reverse=True)
            self._added = re.compile("(" + "|".join(map(re.escape, added)) + ")") if added else None
        enc = lambda s: self.tok(s, add_special_tokens=False, split_special_tokens=True)["input_ids"] if s else []
        if self._added is None or not self._added.search(text):
            return enc(text)
        ids = []
        for i, piece in enumerate(self._added.split(text)):
            ids += enc(piece) if i % 2 == 0 else enc(piece[0]) + enc(piece[1:])
        return ids

    def accepts(self, text: str) -> bool:
        m = self.new()
        ids = self._ids(text)
        return all(m.accept_token(t) for t in ids) and m.accept_token(self.eos)

    def guided(self, x, budget: int = GUIDED_BUDGET) -> str | None:
        """A text of ``x`` the grammar accepts, keys in some order (None: none found within
        ``budget`` pieces written beyond about what writing ``x`` once takes): a depth-first
        search that writes each object's keys one at a time and backtracks across the whole text,
        so that a key order chosen inside a nested object can be undone where a later sibling
        fails (llguidance writes each union member's keys in that member's order, and an open
        member may take another's keys as extra ones: JsonSchemaStore #63's ``minify`` fit the
        ``jsBundle`` member in the order written, and only its ``cssBundle`` order then took
        ``"outputFileName": "a.css"``). Layout as :func:`layouts`' first; floats also plain and
        with trailing zeros, U+007F also escaped."""
        import sys
        m, self._pieces, self._budget = self.new(), [], [budget + 3 * _size(x)]   # + writing x once
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 20000))
        try:
            found = self._value(m, x, lambda: m.accept_token(self.eos))
        except RecursionError:
            found = False
        finally:
            sys.setrecursionlimit(limit)
        return "".join(self._pieces) if found else None

    def _emit(self, m, text: str) -> int | None:
        """Tokens of ``text`` the matcher accepted (None: rejected, state as before)."""
        self._budget[0] -= 1
        if self._budget[0] < 0:
            return None
        ids = self._ids(text) if text else []
        for k, t in enumerate(ids):
            if not m.accept_token(t):
                m.rollback(k)
                return None
        self._pieces.append(text)
        return len(ids)

    def _then(self, m, text: str, cont) -> bool:
        """Write ``text``, then ``cont()``; False: not both, state as before."""
        mark = len(self._pieces)
        n = self._emit(m, text)
        if n is None:
            return False
        if cont():
            return True
        m.rollback(n)
        del self._pieces[mark:]
        return False

    def _value(self, m, x, cont) -> bool:
        """Write ``x`` in some layout, then ``cont()``; False: no layout of ``x`` is followed by a
        successful ``cont()``, state as before."""
        if isinstance(x, dict):
            return self._then(m, "{", lambda: self._members(m, x, list(x), lambda: self._then(m, "}", cont)))
        if isinstance(x, list):
            def items(j: int) -> bool:
                if j == len(x):
                    return self._then(m, "]", cont)
                return self._then(m, ", " if j else "", lambda: self._value(m, x[j], lambda: items(j + 1)))
            return self._then(m, "[", lambda: items(0))
        texts = dict.fromkeys((_dumps(x, False), _dumps(_plain_floats(x), False),
                               _dumps(x, False).replace("\x7f", "\\u007f"), *_padded(x)))
        return any(self._then(m, text, cont) for text in texts)

    def _members(self, m, x: dict, keys: list, cont) -> bool:
        """Write the members ``keys`` of ``x`` in some order, then ``cont()``."""
        if not keys:
            return cont()
        first = len(keys) == len(x)
        for k in keys:
            key = json.dumps(k, ensure_ascii=False).replace("\x7f", "\\u007f")
            rest = [j for j in keys if j != k]
            if self._then(m, ("" if first else ", ") + key + ": ",
                          lambda k=k, rest=rest: self._value(m, x[k], lambda: self._members(m, x, rest, cont))):
                return True
            if self._budget[0] < 0:
                return False
        return False

    def sample(self, rng: random.Random, max_tokens: int = 160) -> str | None:
        """A text the grammar produces (None: no EOS within ``max_tokens``): at each step EOS if
        allowed, else half the time a token with a closing character (``"``, ``}``, ``]``, ``,``)
        and half the time any allowed token, uniformly."""
        import torch
        m, ids = self.new(), []
        vocab = self.compiler.vocab_size
        closing = _closing_tokens(self.tok, vocab)
        for _ in range(max_tokens):
            logits = torch.zeros(1, vocab)
            self.compiler.apply_bitmask(logits, [m])
            allowed = torch.nonzero(logits[0] > -math.inf).flatten().tolist()
            if not allowed:
                return None
            if self.eos in allowed:
                return self.tok.decode(ids)
            close = [t for t in allowed if t in closing]
            t = rng.choice(close if close and rng.random() < 0.5 else allowed)
            if not m.accept_token(t):
                return None
            ids.append(t)
        return None


def _closing_tokens(tok, vocab: int, _cache={}) -> frozenset:
    if vocab not in _cache:
        _cache[vocab] = frozenset(i for i in range(min(vocab, len(tok)))
                                  if any(c in tok.decode([i]) for c in '"}],'))
    return _cache[vocab]


EXAMPLE_CHARS = 4000   # a failing text kept whole up to this length, to find where matching stops


def escaped_names(x) -> str | None:
    """``x`` written with the first character of every property name as a ``\\u`` escape (the
    same instance once decoded), or None where ``x`` has no non-empty name. An invalid instance
    must be rejected written so too: both backends once took an escaped name for an undeclared
    one (``replicas/name_checks.py``)."""
    found = []

    def name(k: str) -> str:
        if not k or ord(k[0]) > 0xFFFF:
            return json.dumps(k, ensure_ascii=False)
        found.append(k)
        return '"\\u%04x' % ord(k[0]) + json.dumps(k[1:], ensure_ascii=False)[1:]

    def enc(v) -> str:
        if isinstance(v, dict):
            return "{" + ", ".join(f"{name(k)}: {enc(w)}" for k, w in v.items()) + "}"
        if isinstance(v, list):
            return "[" + ", ".join(enc(w) for w in v) + "]"
        return _dumps(v, False)
    text = enc(x)
    return text if found else None


def repeated_names(x) -> str | None:
    """``x`` written in the schema's layout with the first name of every non-empty object written
    twice (the same value both times), or None where ``x`` has no object with a name. JSON leaves
    a repeated name's meaning open (RFC 8259 section 4: parsers differ on which value counts), so
    the server refuses it (``replicas/name_checks.py``) and every such text counts as an invalid
    text, whatever ``json.loads`` makes of it: xgrammar once counted ``{"a": 1, "a": 2}`` as two
    properties for ``minProperties``."""
    found = []

    def enc(v) -> str:
        if isinstance(v, dict):
            items = [f"{_dumps(k, False)}: {enc(w)}" for k, w in v.items()]
            if items:
                found.append(1)
                items.insert(1, items[0])
            return "{" + ", ".join(items) + "}"
        if isinstance(v, list):
            return "[" + ", ".join(enc(w) for w in v) + "]"
        return _dumps(v, False)
    text = enc(x)
    return text if found else None


def check_instances(g: Grammar, v, valids: list, invalids: list, schema) -> dict:
    """Counts (and the first failing texts) for one grammar: valid instances rejected in every
    layout, invalid instances accepted in some layout, and each valid instance written with a
    repeated name (:func:`repeated_names`, counted as an invalid text) accepted. A valid instance
    rejected that fails a format the server keeps stricter than the draft
    (:func:`stricter_validator`) counts under ``valid_rejected_format`` instead."""
    r = {"valid": len(valids), "invalid": len(invalids), "valid_rejected": 0, "valid_rejected_format": 0,
         "invalid_accepted": 0, "examples": []}
    stricter = False
    # a text counts as it parses (an integral float written as an integer, draft 4's integer type)
    same = lambda t: t is not None and is_valid(v, json.loads(t)) is not False   # noqa: E731
    for x in valids:
        if not any(g.accepts(t) and same(t) for t in layouts(x, schema)) and not same(g.guided(x)) \
                and not same(g.guided(schema_order(x, schema))):
            if stricter is False:
                stricter = stricter_validator(schema)
            kind = "valid rejected"
            if stricter is not None and is_valid(stricter, x) is False:
                kind = "valid rejected (format the draft leaves unchecked)"
            r["valid_rejected" if kind == "valid rejected" else "valid_rejected_format"] += 1
            r["examples"].append([kind, _dumps(schema_order(x, schema), False)[:EXAMPLE_CHARS]])
        repeated = repeated_names(schema_order(x, schema))
        if repeated is not None:
            r["invalid"] += 1
            if g.accepts(repeated):
                r["invalid_accepted"] += 1
                r["examples"].append(["repeated name accepted", repeated[:EXAMPLE_CHARS]])
    for x in invalids:
        # an accepted text counts as it parses: 3.0678e+24 written as digits is an integer
        texts = layouts(x, schema) + [t for t in (escaped_names(schema_order(x, schema)),) if t is not None]
        hit = next((t for t in texts if g.accepts(t) and is_valid(v, json.loads(t)) is False), None)
        for text in (() if hit else (g.guided(x, GUIDED_BUDGET_INVALID),
                                     g.guided(schema_order(x, schema), GUIDED_BUDGET_INVALID))):
            if text is not None and is_valid(v, json.loads(text)) is False:
                hit = "(in another key order) " + text
                break
        if hit is not None:
            r["invalid_accepted"] += 1
            r["examples"].append(["invalid accepted", hit[:EXAMPLE_CHARS]])
    return r


def check_samples(g: Grammar, v, n: int, rng: random.Random) -> dict:
    """``n`` grammar samples: how many ended, how many of those are not valid JSON or not valid."""
    r = {"samples": 0, "samples_invalid": 0, "examples": [], "valid_values": []}
    for _ in range(n):
        text = g.sample(rng)
        if text is None:
            continue
        r["samples"] += 1
        try:
            ok = is_valid(v, json.loads(text))
        except ValueError:
            ok = False
        if ok is False:
            r["samples_invalid"] += 1
            r["examples"].append(["sample invalid", text[:EXAMPLE_CHARS]])
        elif ok:
            value = json.loads(text)
            try:   # (a seed for mutations: a number past float's range, 1e999, would not print back)
                json.dumps(value, allow_nan=False)
                r["valid_values"].append(value)
            except ValueError:
                pass
    return r


class _Timeout(Exception):
    pass


def _alarm(seconds: float):
    """Raise :class:`_Timeout` after ``seconds`` of this process's CPU time (not wall time: on a
    shared machine a niced worker waits for the CPU), and again every 0.5 s until the timer is
    cleared (an exception raised inside a gc callback is dropped by Python)."""
    def handler(*_):
        raise _Timeout()
    signal.signal(signal.SIGPROF, handler)
    signal.setitimer(signal.ITIMER_PROF, seconds, 0.5)


def check_schema(compiler, tok, schema, seed: int = 0, n_valid: int = N_VALID, n_invalid: int = N_INVALID,
                 n_samples: int = N_SAMPLES, before_backend: str | None = None, schema_s: float = 30.0) -> dict:
    """One schema's record: ``status`` (served / refused / timeout), ``backend``, ``na`` (why
    hypothesis-jsonschema does not apply, or ""), the counts of :func:`check_instances` and
    :func:`check_samples`, and under ``before`` the instance counts with ``before_backend``
    (where given and different). Generation and matching stop after ``schema_s`` seconds of CPU
    time (``status`` "bounded", counts so far kept)."""
    from replicas.errors import GrammarCompileError
    rec = {"status": "served", "backend": None, "na": "", "valid": 0, "invalid": 0, "valid_rejected": 0,
           "invalid_accepted": 0, "samples": 0, "samples_invalid": 0, "examples": []}
    if not isinstance(schema, (dict, bool)):
        return {**rec, "status": "refused", "reason": "not a schema object"}
    try:
        g = Grammar(compiler, tok, schema)
    except GrammarCompileError as e:
        timeout = "did not compile within" in str(e)
        return {**rec, "status": "timeout" if timeout else "refused", "reason": str(e)[:200]}
    rec["backend"] = g.backend
    rng = random.Random(seed)
    v = validator(schema)
    _alarm(schema_s)
    try:
        valids, rec["na"] = valid_instances(typed(schema), n_valid, seed)
        kept = [x for x in valids if is_valid(v, x)]
        rec["generated_not_valid"] = len(valids) - len(kept)
        seeds, s = kept, None
        if not kept:
            # hypothesis-jsonschema gave nothing (a recursive schema, say): the invalid instances
            # are mutations of the grammar's own valid samples instead (soundness only: those
            # samples are accepted by construction, so they are not counted as valid tried)
            s = check_samples(g, v, n_samples, rng)
            seeds = s["valid_values"][:max(n_valid, 1)]
            rec["invalid_seeds"] = "grammar samples" if seeds else ""
        invalids = invalid_instances(v, seeds, n_invalid, rng)
        r = check_instances(g, v, kept, invalids, schema)
        s = s or check_samples(g, v, n_samples, rng)
        rec.update({k: s[k] for k in ("samples", "samples_invalid")})
        rec.update({k: r[k] for k in ("valid", "invalid", "valid_rejected", "valid_rejected_format", "invalid_accepted")})
        rec["examples"] = r["examples"][:3] + s["examples"][:2]
        if before_backend and before_backend != g.backend:
            signal.setitimer(signal.ITIMER_PROF, 0)
            try:
                gb = Grammar(compiler, tok, schema, backend=before_backend)
                _alarm(schema_s)
                b = check_instances(gb, v, kept, invalids, schema)
                rec["before"] = {"backend": before_backend, **{k: b[k] for k in ("valid_rejected", "invalid_accepted")}}
            except GrammarCompileError as e:
                rec["before"] = {"backend": before_backend, "status": "refused", "reason": str(e)[:200]}
    except _Timeout:
        rec["status"] = "bounded"
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
    return rec


# ---------------------------------------------------------------------------------- the run
def _compiler(timeout_s: float):
    from bench.grammar_coverage import _compiler
    return _compiler(timeout_s)


def _worker(todo: list, args: dict, conn) -> None:
    """Check the (subset, index) pairs of ``todo`` in order, sending (pair, record) for each."""
    from replicas.grammar import GrammarSpec, _check, backend_for
    before = _before_check(args["before_ref"]) if args["before_ref"] else None
    tok, compiler = _compiler(args["timeout_s"])
    for name, i in todo:
        schema = _load(name)[i]
        before_backend = first = None
        if isinstance(schema, dict):
            first = backend_for(_check(GrammarSpec("json_schema", schema)))
            if before is not None:
                before_backend = "llguidance" if before(schema) else "xgrammar"
        t0 = time.perf_counter()
        rec = check_schema(compiler, tok, schema, seed=i, n_valid=args["valid"], n_invalid=args["invalid"],
                           n_samples=args["samples"], before_backend=before_backend, schema_s=args["schema_s"])
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        rec["schema_backend_for"] = first
        conn.send(((name, i), rec))
        if rec["status"] == "timeout":
            return   # xgrammar's compile thread cannot be stopped: a fresh worker goes on
    conn.send(None)


def order(subsets: list[str], limit: int | None, seed: int = 0) -> list:
    """Every (subset, index) to check: each subset in a seeded random order, the subsets
    interleaved so that each is the same fraction done at any time (a stopped run has checked a
    uniform random sample of every subset)."""
    keyed = []
    for name in subsets:
        n = len(_load(name))
        n = min(n, limit) if limit else n
        perm = list(range(n))
        random.Random(f"{seed}:{name}").shuffle(perm)
        keyed += [((rank + 0.5) / n, name, i) for rank, i in enumerate(perm)]
    return [(name, i) for _, name, i in sorted(keyed)]


def run(subsets: list[str] | None, checkpoint: Path, args: dict) -> None:
    """Check every schema of the chosen subsets not yet in ``checkpoint`` (one JSON record per
    line: subset, index, :func:`check_schema`'s record) in :func:`order`, one worker process at
    a time; a worker that dies or hangs costs its schema (status "crashed") and a fresh worker
    goes on."""
    done = set()
    if checkpoint.is_file():
        for line in checkpoint.read_text().splitlines():
            r = json.loads(line)
            done.add((r["subset"], r["i"]))
        if args.get("recheck_moved"):
            done -= _moved(checkpoint)
        if args.get("recheck_failing"):
            done -= _failing(checkpoint)
    names = subsets or sorted(p.name.split(".")[0] for p in JSONSCHEMABENCH_DIR.glob("*.jsonl.gz"))
    todo = [p for p in order(names, args["limit"])
            if (p in args["recheck"] if args.get("recheck") else p not in done)]
    ctx = mp.get_context("spawn")
    with checkpoint.open("a") as out:
        while todo:
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker, args=(todo, args, child), daemon=True)
            proc.start()
            child.close()
            first = True
            while todo:
                wait = max(300.0, args["schema_s"] * 10 + args["timeout_s"] * 3)   # wall time, a loaded machine
                try:
                    msg = parent.recv() if parent.poll(wait) else "hung"
                except EOFError:
                    msg = "crashed"
                first = False
                if msg is None:
                    todo = []
                    break
                if msg in ("crashed", "hung"):   # on the first pair not reported
                    (name, i), todo = todo[0], todo[1:]
                    out.write(json.dumps({"subset": name, "i": i, "status": "crashed", "reason": msg}) + "\n")
                    out.flush()
                    break
                (name, i), rec = msg
                assert (name, i) == todo[0]
                todo = todo[1:]
                out.write(json.dumps({"subset": name, "i": i, **rec}) + "\n")
                out.flush()
                if rec["status"] == "timeout":
                    break
            proc.kill()
            proc.join()
            print(f"{len(todo)} left", file=sys.stderr, flush=True)


def _moved(checkpoint: Path) -> set:
    """(subset, index) of the served records whose backend this code's routing no longer picks
    first (a routing change after they ran); the last record of a schema counts."""
    from replicas.grammar import GrammarSpec, _check, backend_for
    last = {}
    for line in checkpoint.read_text().splitlines():
        r = json.loads(line)
        last[(r["subset"], r["i"])] = r
    moved = set()
    for key, r in last.items():
        if r["status"] in ("served", "bounded") and r.get("schema_backend_for"):
            schema = _load(key[0])[key[1]]
            if backend_for(_check(GrammarSpec("json_schema", schema))) != r["schema_backend_for"]:
                moved.add(key)
    return moved


def _failing(checkpoint: Path) -> set:
    """(subset, index) of the records with a valid instance rejected, an invalid one accepted or
    an invalid grammar sample (to run again after a fix); the last record of a schema counts."""
    last = {}
    for line in checkpoint.read_text().splitlines():
        r = json.loads(line)
        last[(r["subset"], r["i"])] = r
    return {k for k, r in last.items()
            if r.get("valid_rejected") or r.get("invalid_accepted") or r.get("samples_invalid")}


@functools.lru_cache(maxsize=None)
def _load(subset: str) -> list:
    with gzip.open(JSONSCHEMABENCH_DIR / f"{subset}.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f]
    out = []
    for row in rows:
        schema = row.get("json_schema", row.get("schema", row))
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                pass
        out.append(schema)
    return out


def summarize(checkpoint: Path) -> dict:
    """Per subset counts from the checkpoint, and a few examples of each failure kind."""
    keys = ("schemas", "served", "refused", "timeout", "crashed", "bounded", "xgrammar", "llguidance", "na",
            "valid", "invalid", "valid_rejected", "valid_rejected_format", "invalid_accepted", "samples",
            "samples_invalid", "schemas_valid_rejected", "schemas_invalid_accepted", "moved", "before_valid_rejected",
            "before_invalid_accepted", "before_refused")
    per = collections.defaultdict(lambda: dict.fromkeys(keys, 0))
    examples = collections.defaultdict(list)
    by_fix = {}
    last = {}
    for line in checkpoint.read_text().splitlines():
        r = json.loads(line)
        last[(r["subset"], r["i"])] = r   # a recheck's record replaces the earlier one
    for r in last.values():
        c = per[r["subset"]]
        c["schemas"] += 1
        st = r["status"]
        c[st] += 1
        if st not in ("served", "bounded"):
            continue
        c["served"] += st == "bounded"
        c[r["backend"]] += 1
        c["na"] += bool(r["na"])
        for k in ("valid", "invalid", "valid_rejected", "invalid_accepted", "samples", "samples_invalid"):
            c[k] += r[k]
        c["valid_rejected_format"] += r.get("valid_rejected_format", 0)   # (records before the split: 0)
        c["schemas_valid_rejected"] += r["valid_rejected"] > 0
        c["schemas_invalid_accepted"] += r["invalid_accepted"] > 0 or r["samples_invalid"] > 0
        b = r.get("before")
        if b:
            for reason in _move_reasons(r["subset"], r["i"]):
                f = by_fix.setdefault(reason, dict.fromkeys(("schemas", "valid", "invalid", "before_valid_rejected",
                                                             "before_invalid_accepted", "before_refused",
                                                             "valid_rejected", "invalid_accepted"), 0))
                f["schemas"] += 1
                for k in ("valid", "invalid", "valid_rejected", "invalid_accepted"):
                    f[k] += r[k]
                f["before_refused"] += b.get("status") == "refused"
                f["before_valid_rejected"] += b.get("valid_rejected", 0)
                f["before_invalid_accepted"] += b.get("invalid_accepted", 0)
            c["moved"] += 1
            c["before_refused"] += b.get("status") == "refused"
            c["before_valid_rejected"] += b.get("valid_rejected", 0)
            c["before_invalid_accepted"] += b.get("invalid_accepted", 0)
        for kind, text in r.get("examples", []):
            if len(examples[kind]) < 12:
                examples[kind].append({"subset": r["subset"], "i": r["i"], "backend": r["backend"], "text": text})
    total = dict.fromkeys(keys, 0)
    for c in per.values():
        for k in keys:
            total[k] += c[k]
    return {"subsets": dict(sorted(per.items())), "total": total, "by_fix": dict(sorted(by_fix.items())),
            "examples": dict(examples)}


def _move_reasons(subset: str, i: int) -> list[str]:
    """The completeness classes (:func:`replicas.grammar.incomplete_keywords`) that moved a
    schema from xgrammar to llguidance."""
    import re

    from replicas.grammar import incomplete_keywords
    return sorted({re.sub(r" at \$.*", "", p) for p in incomplete_keywords(_load(subset)[i])})


def fix_table(summary: dict) -> str:
    """Schemas moved to llguidance by each completeness class (a schema may count under several):
    the same instances with main's backend (before) and now (after)."""
    lines = ["| moved for | schemas | valid tried | invalid tried | before: valid rejected | "
             "before: invalid accepted | after: valid rejected | after: invalid accepted |", "|---|" + "---:|" * 7]
    for reason, f in summary.get("by_fix", {}).items():
        lines.append(f"| {reason} | {f['schemas']:,} | {f['valid']:,} | {f['invalid']:,} | {f['before_valid_rejected']:,} | "
                     f"{f['before_invalid_accepted']:,} | {f['valid_rejected']:,} | {f['invalid_accepted']:,} |")
    return "\n".join(lines) + "\n"


def table(summary: dict) -> str:
    cols = [("schemas", "schemas"), ("served", "served"), ("xgrammar", "(xgrammar)"), ("llguidance", "(llguidance)"),
            ("na", "h-j n/a"), ("valid", "valid tried"), ("invalid", "invalid tried"),
            ("invalid_accepted", "invalid accepted"), ("valid_rejected", "valid rejected"),
            ("valid_rejected_format", "valid rejected: stricter format"),
            ("samples", "grammar samples"), ("samples_invalid", "samples invalid"), ("bounded", "bounded"),
            ("moved", "moved"), ("before_invalid_accepted", "before: invalid accepted"),
            ("before_valid_rejected", "before: valid rejected")]
    lines = ["| subset | " + " | ".join(h for _, h in cols) + " |", "|---|" + "---:|" * len(cols)]
    for name, c in list(summary["subsets"].items()) + [("**total**", summary["total"])]:
        lines.append(f"| {name} | " + " | ".join(f"{c[k]:,}" for k, _ in cols) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.grammar_soundness", description=__doc__.split("\n\n")[0])
    ap.add_argument("suite", choices=("jsonschemabench",))
    ap.add_argument("--subsets", nargs="+")
    ap.add_argument("--limit", type=int, help="schemas per subset (the first N)")
    ap.add_argument("--checkpoint", type=Path, default=Path("grammar_soundness.ckpt.jsonl"))
    ap.add_argument("--timeout-s", type=float, default=10.0, help="compile time bound")
    ap.add_argument("--schema-s", type=float, default=10.0, help="generation + matching bound per schema")
    ap.add_argument("--valid", type=int, default=N_VALID)
    ap.add_argument("--invalid", type=int, default=N_INVALID)
    ap.add_argument("--samples", type=int, default=N_SAMPLES)
    ap.add_argument("--before-ref", default="main", help="also check with this git ref's backend choice ('' to skip)")
    ap.add_argument("--summary-only", action="store_true", help="only summarize the checkpoint")
    ap.add_argument("--recheck-moved", action="store_true",
                    help="run again the checkpoint's schemas whose backend this code picks differently")
    ap.add_argument("--recheck-failing", action="store_true",
                    help="run again the checkpoint's schemas with a failure (valid rejected, invalid accepted)")
    ap.add_argument("--recheck", type=Path,
                    help="a JSONL file of {subset, i}: check only those schemas again (a change that moves them)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    a = ap.parse_args(argv)
    if not a.summary_only:
        run(a.subsets, a.checkpoint, {"timeout_s": a.timeout_s, "schema_s": a.schema_s, "valid": a.valid,
                                      "invalid": a.invalid, "samples": a.samples, "limit": a.limit,
                                      "before_ref": a.before_ref or None, "recheck_moved": a.recheck_moved,
                                      "recheck_failing": a.recheck_failing,
                                      "recheck": {(r["subset"], r["i"]) for r in map(json.loads, filter(None, a.recheck.read_text().splitlines()))}
                                      if a.recheck else None})
    summary = summarize(a.checkpoint)
    print(table(summary))
    print(fix_table(summary))
    if a.json:
        a.json.write_text(json.dumps(summary, indent=1) + "\n")
    if a.markdown:
        a.markdown.write_text(table(summary) + "\n" + fix_table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
