"""Constrained decoding with two backends, xgrammar and llguidance: grammar specs, the choice of
backend per spec, a compiled-grammar cache, time- and memory-bounded compilation, and per-step
token bitmasks for a batch that may mix backends.

Which backend serves a spec (measured with xgrammar 0.2.9 and llguidance 1.9, see
``docs/grammar_backends.md``): xgrammar where it enforces every keyword of a JSON schema
(:func:`unenforced_keywords` finds none), llguidance where it does not, and a refusal
(:class:`GrammarCompileError` naming the keyword and where) where neither enforces it. Lark
grammars go to llguidance (its native syntax), regexes with look-around or xgrammar's
optional-group bug to llguidance (which refuses look-around), everything else to xgrammar. Both
sit behind one matcher interface (:class:`Matcher`), so the engine, the tagger and PASK do not
see the backend.

A :class:`GrammarSpec` names what the output must follow: a JSON schema, any JSON object, a
regex, one of several strings (``choice``), an EBNF or Lark grammar, or tool calls in the Qwen3
``<tool_call>`` format (xgrammar's ``get_model_structural_tag("qwen_3", ...)``) with each tool's
argument schema and ``tool_choice`` auto / required / none / named.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import logging
import math
import re
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from replicas.errors import GrammarCompileError, GrammarCompileLimitError
from replicas.format_regex import REGEX_PATTERN

logger = logging.getLogger(__name__)

KINDS = ("json_schema", "json_object", "regex", "choice", "ebnf", "lark", "tools")


@dataclass(frozen=True)
class GrammarSpec:
    """What the generated text must follow.

    ``value`` by kind: json_schema: a schema (dict or JSON string); json_object: ignored;
    regex: a pattern; choice: a list of strings; ebnf: grammar text (GBNF, root rule ``root``);
    lark: Lark grammar text (start rule ``start``, as vLLM / llguidance take it);
    tools: ``{"tools": [OpenAI tool entries], "tool_choice": "auto" | "required" | "none" |
    {"type": "function", "function": {"name": ...}}, "parallel_tool_calls": bool}``.
    """
    kind: str
    value: Any = None
    strict: bool = False  # json_schema: no properties or items beyond those the schema names

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GrammarCompileError(f"unknown grammar kind {self.kind!r}; choose from {', '.join(KINDS)}")

    def key(self) -> str:
        """The compile cache's key. Keys keep the order they were written in (no ``sort_keys``):
        both backends write an object's properties in the schema's ``properties`` order (and
        llguidance merges ``allOf`` members in the text's order), so two schemas that differ
        only in that order are two grammars (a sorted key served the second one the first's
        property order)."""
        return self.kind + (":strict:" if self.strict else ":") + json.dumps(self.value, default=str)


# Keywords xgrammar 0.2.9 compiles but does not enforce (seen: outputs breaking them under the
# grammar); a schema using one is refused rather than served with output that breaks it.
_UNENFORCED = ("contains", "minContains", "maxContains", "not", "if", "then", "else", "dependentSchemas",
               "unevaluatedProperties", "unevaluatedItems",
               # measured (issue 20): xgrammar 0.2.9 drops these silently ({"type": "number",
               # "multipleOf": 0.5} accepted 1.3; dependentRequired / dependencies ignored;
               # patternProperties keys went in untyped or not at all)
               "multipleOf", "dependentRequired", "dependencies", "patternProperties")
# Formats xgrammar 0.2.9 checks only by shape: "2020-02-31" passed format date (and date-time).
# hostname: a 64-character label accepted (and "A.COM", "a.com." rejected). email: RFC 5321
# addresses rejected ("h@x.M.AIG", "N&@ZvIMDNu.Z.Hn": JSONSchemaBench, hypothesis' emails()).
# regex, iri, iri-reference, idn-hostname: not checked at all ("(" passed format regex, "a b" iri).
_XGR_LOOSE_FORMATS = ("date", "date-time", "time", "hostname", "host-name", "email", "idn-email",   # time: "23:59:60Z" accepted
                      "regex", "iri", "iri-reference", "idn-hostname")
_LOOKAROUND = re.compile(r"\(\?<?[=!]")
# xgrammar 0.2.9 reads a node without "type" as any JSON value and drops the keywords of a single
# type there (measured: {"pattern": "^a+$"} took "b", {"minLength": 3} "b", {"minimum": 3} 1,
# {"maxItems": 1} [1, 2], {"minProperties": 1} {}; JSONSchemaBench Github_medium #7, a "type"
# key misspelled, let " 00/0" past a pattern). It reads "items" / "prefixItems" as an array and
# "properties" / "additionalProperties" / "patternProperties" as an object, and then enforces
# their size keywords; nothing makes it read a string or a number.
_UNTYPED_STRING_NUMBER = ("pattern", "minLength", "maxLength", "format", "minimum", "maximum",
                          "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_UNTYPED_ARRAY = (("minItems", "maxItems", "uniqueItems"), ("items", "prefixItems"))
_UNTYPED_OBJECT = (("minProperties", "maxProperties"), ("properties", "additionalProperties", "patternProperties"))
_NOT_SCHEMAS = ("const", "enum", "default", "examples", "description", "title", "$comment")
_NAME_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema


def _walk(schema: Any):
    """(node, where) for every schema node of ``schema``: subschemas under every keyword but the
    value keywords (``const``, ``enum``, ...), the members of name maps (``properties``, ...)."""
    stack = [(schema, "$")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, list):
            stack.extend((x, f"{where}[{i}]") for i, x in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        yield node, where
        for k, v in node.items():
            if k in _NAME_MAPS and isinstance(v, dict):
                stack.extend((sub, f"{where}.{k}.{name}") for name, sub in v.items())
            elif k not in _NOT_SCHEMAS:
                stack.append((v, f"{where}.{k}"))


def unenforced_keywords(schema: Any) -> list[str]:
    """JSON-pointer-ish places where ``schema`` uses a keyword xgrammar does not enforce (such a
    schema goes to llguidance, :func:`backend_for`): the keywords above, ``format: date`` /
    ``date-time``, a ``pattern`` with look-around, ``uniqueItems: true``, ``allOf`` with several members, ``pattern`` or
    ``format`` together with ``minLength`` / ``maxLength`` (the lengths are dropped), ``anyOf`` /
    ``oneOf`` / ``allOf`` / ``$ref`` beside other constraints (the siblings are dropped), ``oneOf``
    whose members may overlap (it is compiled as ``anyOf``), a ``required`` name missing from
    ``properties``, ``enum`` / ``const`` values outside the node's ``type``, and a ``$ref`` that is
    not a local JSON pointer (it would match anything), and a string, number, array-size or
    object-size keyword on a node without ``type`` (:data:`_UNTYPED_STRING_NUMBER`). Seen with
    xgrammar 0.2.9: output breaking the schema under the grammar."""
    found = []
    for node, where in _walk(schema):
        found += [f"{k} at {where}" for k in _UNENFORCED if k in node]
        if node.get("uniqueItems") is True:
            found.append(f"uniqueItems at {where}")
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            found.append(f"allOf at {where}")
        if ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
            found.append(f"{'pattern' if 'pattern' in node else 'format'} with minLength / maxLength at {where}")
        if node.get("format") in _XGR_LOOSE_FORMATS:
            found.append(f"format {node['format']} at {where}")
        if isinstance(node.get("pattern"), str) and _LOOKAROUND.search(node["pattern"]):
            found.append(f"pattern with look-around at {where}")
        if "type" not in node:
            found += [f"{k} without type at {where}" for k in _UNTYPED_STRING_NUMBER
                      if k in node and (k != "format" or (isinstance(node[k], str) and node[k] in _DEFINED_FORMATS))]
            for keys, anchors in (_UNTYPED_ARRAY, _UNTYPED_OBJECT):
                if not any(a in node for a in anchors):
                    found += [f"{k} without type at {where}" for k in keys if k in node]
        found += _dropped_constraints(node, where)
    return found


def _anchored_whole(pattern: str) -> bool:
    """Whether ``pattern`` only matches whole strings as JSON Schema reads it (unanchored): it
    starts with ``^``, ends with an unescaped ``$`` and has no top-level ``|``."""
    if not (pattern.startswith("^") and pattern.endswith("$")) or pattern.endswith("\\$"):
        return False
    return not any(pattern[i] == "|" for i, _ in _top_level_atoms(pattern))


# A pattern that may match a character JSON writes escaped (a quote, a backslash, a control
# character): any-character classes, negated classes, \s (newline, tab), a quote or backslash.
_ESCAPABLE = re.compile(r'(?<!\\)\.|\\[SWDspPntrfvxuc0]|\[\^|"|\\\\')


def _class_range_escapes(pattern: str) -> bool:
    """Whether a character class of ``pattern`` holds a range over a character JSON writes
    escaped: one starting below U+0020, or spanning ``"`` or ``\\`` (``[ -_]``, ``[A-z]``,
    ``[0-f]``: xgrammar 0.2.9 rejected ``"\\"`` and ``"\""`` under such classes, found by
    ``bench.pattern_crosscheck jsonschemabench``, stop 45). Read with Python's parser; a pattern
    it cannot read counts as without one."""
    from replicas.regex_complement import _c, _p, _somewhere
    try:
        tree = _p.parse(pattern)
    except Exception:   # (not Python syntax: the other checks decide)
        return False
    return _somewhere(tree, lambda op, av: op is _c.IN and any(
        o is _c.RANGE and (a[0] < 0x20 or a[0] <= 0x22 <= a[1] or a[0] <= 0x5C <= a[1]) for o, a in av))


def incomplete_keywords(schema: Any) -> list[str]:
    """Places where xgrammar 0.2.9 would reject valid instances (sound, but not complete): a
    ``pattern`` not anchored at both ends (JSON Schema searches it, xgrammar matches it whole:
    ``"^pkg:"`` rejected ``"pkg:x"``); a pattern that may match a character JSON escapes
    (xgrammar matches it against the escaped text: ``"a\\"b"`` failed ``^[\\S]+$``); a string
    length bound (``minLength`` / ``maxLength``: every JSON escape refused, ``"a\\nb"`` for
    ``maxLength: 5``); ``format: uri-reference`` (``"https://x.org/a"`` rejected); a ``number``
    with a bound (at most 6 fractional digits: ``2.9294384834`` rejected for ``maximum: 360``).
    llguidance 1.9 accepts these (measured, ``docs/grammar_backends.md``); such a schema goes to
    llguidance and falls back to xgrammar where llguidance refuses it
    (:meth:`GrammarCompiler.compile`)."""
    found = []
    for node, where in _walk(schema):
        if isinstance(node.get("pattern"), str) and not _anchored_whole(node["pattern"]):
            found.append(f"pattern not anchored at both ends at {where}")
        elif isinstance(node.get("pattern"), str) and (_ESCAPABLE.search(node["pattern"])
                                                       or _class_range_escapes(node["pattern"])):
            found.append(f"pattern that may match a character JSON escapes at {where}")
        if node.get("format") == "uri-reference":
            found.append(f"format uri-reference at {where}")
        if "propertyNames" in node:
            found.append(f"propertyNames at {where}")   # xgrammar rejected valid keys
        types = node.get("type") if isinstance(node.get("type"), list) else [node.get("type")]
        if "number" in types and any(k in node for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
            found.append(f"number with a bound at {where}")
        if (None in types or "string" in types) and ("maxLength" in node or node.get("minLength") not in (None, 0)):
            found.append(f"string length bound at {where}")
    return found


_CONSTRAINTS = ("type", "properties", "required", "items", "prefixItems", "additionalProperties",
                "patternProperties", "enum", "const", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                "multipleOf", "minLength", "maxLength", "pattern", "format", "minItems", "maxItems",
                "minProperties", "maxProperties", "propertyNames")
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "object": (dict,), "array": (list,), "null": (type(None),)}


def _matches_type(value: Any, types: Any) -> bool:
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list):
        return True
    for t in types:
        py = _JSON_TYPES.get(t)
        if py is None:
            return True  # an unknown type name: xgrammar reports it
        if isinstance(value, bool) and t in ("integer", "number"):
            continue
        if t == "integer" and isinstance(value, float) and value.is_integer():
            return True
        if isinstance(value, py):
            return True
    return False


def _disjoint_members(members: list) -> bool:
    """oneOf members that no value can match twice: distinct single types (not integer beside
    number), or const / enum values that do not repeat."""
    types = [m.get("type") if isinstance(m, dict) else None for m in members]
    if all(isinstance(t, str) for t in types) and len(set(types)) == len(types) \
            and not {"integer", "number"} <= set(types):
        return True
    values = []
    for m in members:
        if not isinstance(m, dict) or not ("const" in m or isinstance(m.get("enum"), list)):
            return False
        values += [m["const"]] if "const" in m else m["enum"]
    keys = [json.dumps(v, sort_keys=True) for v in values]
    return len(set(keys)) == len(keys)


def _atom_end(p: str, i: int) -> int:
    """Index just past the regex atom starting at ``p[i]`` (an escape, a class, a group, a char)."""
    if p[i] == "\\":
        return min(i + 2, len(p))
    if p[i] == "[":
        j = i + 1
        if j < len(p) and p[j] == "^":
            j += 1
        if j < len(p) and p[j] == "]":
            j += 1
        while j < len(p) and p[j] != "]":
            j += 2 if p[j] == "\\" else 1
        return min(j + 1, len(p))
    if p[i] == "(":
        depth, j = 0, i
        while j < len(p):
            if p[j] == "\\":
                j += 2
                continue
            if p[j] == "[":
                j = _atom_end(p, j)
                continue
            depth += p[j] == "("
            depth -= p[j] == ")"
            j += 1
            if depth == 0:
                return j
        return len(p)
    return i + 1


def _may_repeat_zero(p: str, i: int) -> bool:
    return i < len(p) and (p[i] in "*?" or p.startswith("{0", i) or p.startswith("{,", i))


def _top_level_atoms(p: str):
    """(start, end) of each top-level atom of ``p`` (a group counts as one)."""
    i = 0
    while i < len(p):
        j = _atom_end(p, i)
        yield i, j
        i = j


def _groups(pattern: str):
    """``(text, end, alternatives)`` of every group in ``pattern``, at any depth: ``text[end:]`` is
    what follows the group (its quantifier) and ``alternatives`` its body split at top-level ``|``
    (a non-capturing or named group's prefix removed). No recursion: nesting is the client's."""
    stack = [pattern]
    while stack:
        p = stack.pop()
        for i, j in _top_level_atoms(p):
            if p[i] != "(":
                continue
            body = _group_body(p[i:j])
            yield p, j, _split_alternatives(body)
            stack.append(body)


def _group_body(group: str) -> str:
    """The body of group text ``(...)``, a non-capturing or named group's prefix removed."""
    body = group[1:-1]
    if body.startswith("?:"):
        return body[2:]
    if body.startswith("?<") and body[2:3] not in ("=", "!"):  # a named group
        return body[body.find(">") + 1:]
    return body


def _split_alternatives(body: str) -> list[str]:
    """``body`` split at its top-level ``|``."""
    alts, start = [], 0
    for k, m in _top_level_atoms(body):
        if body[k] == "|":
            alts.append(body[start:k])
            start = m
    alts.append(body[start:])
    return alts


def optional_group_starting_optional(pattern: str) -> bool:
    """Whether ``pattern`` has a group that may be skipped (``(...)?``, ``(...)*``) whose body, or
    one of its alternatives, starts with an atom that may be empty (``(\\s*\\+json)?``). xgrammar
    0.2.9 then accepts the empty-able atom alone: ``^v(x*j)?$`` accepted ``"vx"`` (seen in a
    JSONSchemaBench MIME-type pattern: output ``"video/s_data "`` broke it)."""
    return any(_may_repeat_zero(p, j) and any(alt and _may_repeat_zero(alt, _atom_end(alt, 0)) for alt in alts)
               for p, j, alts in _groups(pattern))


def _split_quantifier(alt: str) -> tuple[int, str]:
    """``(start of alt's last atom, the quantifier after it)``: ``"x(0{1,2})?"`` -> ``(1, "?")``,
    ``"x0{1,4}?"`` -> ``(1, "{1,4}?")``; ``(-1, "")`` for an empty ``alt``."""
    atoms = list(_top_level_atoms(alt))
    k = len(atoms)
    while k:
        text = alt[atoms[k - 1][0]:atoms[k - 1][1]]
        if text in ("*", "+", "?"):
            k -= 1
            continue
        if text == "}":   # a brace quantifier comes as single-character atoms
            m = k - 2
            while m >= 0 and alt[atoms[m][0]:atoms[m][1]] in tuple("0123456789,"):
                m -= 1
            if m >= 0 and alt[atoms[m][0]] == "{" and m < k - 2:
                k = m
                continue
        break
    if not k:
        return -1, alt
    return atoms[k - 1][0], alt[atoms[k - 1][1]:]


def _variable_count(quantifier: str) -> bool:
    """Whether ``quantifier`` (``*``, ``+``, ``{m,n}``, ``{m,}``, lazy or not) repeats its atom a
    variable number of times, ``?`` / ``{0,1}`` aside."""
    if quantifier[:1] in ("*", "+"):
        return True
    m = re.match(r"\{(\d*),(\d*)\}", quantifier)
    if m is None:
        return False
    lo, hi = int(m.group(1) or 0), m.group(2)
    return hi == "" or (lo < int(hi) and (lo, int(hi)) != (0, 1))


def _ends_variable(alt: str, depth: int = 0) -> bool:
    """Whether ``alt`` ends with an atom repeated a variable number of times, looking into a
    final group's alternatives (``x(0{1,2})``, ``x(0{1,2})?``)."""
    start, quantifier = _split_quantifier(alt)
    if start < 0 or depth > 16:
        return False
    if _variable_count(quantifier):
        return True
    if alt[start] != "(":
        return False
    body = _group_body(alt[start:len(alt) - len(quantifier)])
    return any(_ends_variable(a, depth + 1) for a in _split_alternatives(body))


def optional_group_with_repeated_end(pattern: str) -> bool:
    """Whether ``pattern`` has a group that may be skipped once (``(...)?``, ``(...)??``,
    ``(...){0,1}``) whose body, or one of its alternatives, starts with an atom repeated without
    bound (``*``, ``+``, ``{n,}``) or ends with one repeated a variable number of times (those,
    and ``{m,n}`` with m < n; looked for through a final group). In a schema's string xgrammar
    0.2.9 then accepts part of the body alone: ``^(ab*)?c$`` accepted ``"bc"`` (a JSONSchemaBench
    pattern, ``^([ZB][1-9][0-9]*)?K[1-9][0-9]*$``: a grammar sample ``"434602470600400302K144"``
    broke it), ``^x(a+b)?$`` accepted ``"xa"`` (the ISO 8601 duration pattern
    ``^-?P([0-9]+Y)?([0-9]+M)?...$`` accepted ``"-P9"``, bench.grammar_soundness), ``^a(x0{1,2})?$``
    and ``^a(x(0{1,2}))?$`` accepted ``"a0"`` (a date-time pattern ending
    ``:[0-9]{2}(\\.[0-9]{1,4})?$`` accepted ``"...:570"``: a grammar sample, JSONSchemaBench
    Github_medium #1452; semver's ``(\\+[0-9a-z]+(\\.[0-9a-z]+)*)?`` accepted ``"1.0.0.a"``).
    Found right, by comparing with Python's ``re`` on every string of four characters or fewer:
    ``(a[0-9]*b)?``, ``(a{1,2}b)?``, ``(ab{2})?``, ``(ab?)?``, ``(a+b)*``, ``(ab{1,2}){0,2}``, and
    ``(a+b){0,1}`` (counted here all the same, as it was before that comparison)."""
    def repeated_start(alt: str) -> bool:
        atoms = list(_top_level_atoms(alt))   # a quantifier is an atom of its own: "x*" -> atoms x, *
        first = re.match(r"\{\d+,\}", alt[atoms[1][0]:]) if len(atoms) >= 2 else None   # "{n," is several atoms
        return len(atoms) >= 2 and (alt[atoms[1][0]] in "*+" or first is not None)
    return any((p.startswith("?", j) or p.startswith("{0,1}", j))
               and any(repeated_start(a) or _ends_variable(a) for a in alts)
               for p, j, alts in _groups(pattern))


_VARIABLE_BRACE = re.compile(r"(?<!\\)\{(\d*),(\d*)\}")


def alternation_with_bounded_repeat(pattern: str) -> bool:
    """Whether ``pattern`` has an alternation (a group's, or the whole pattern's) one of whose
    alternatives holds a bounded variable count (``{m,n}`` with m < n, ``{0,1}`` too). In a
    schema's string xgrammar 0.2.9 then may accept unbounded repeats: ``^(0{1,2}|0)$`` accepted
    ``"0000"``, ``^(a|0{1,2}|0)$`` accepted ``"a0"``, ``^(00{0,1}|0)$`` ``"000"`` (random patterns
    compared with Python's ``re`` on every short string; ``(0{1,2}|1)``, ``(0{1,}|0)``,
    ``(00?|0)`` were right). Counted wherever it appears: the exact condition is not known."""
    def variable(text: str) -> bool:
        return any(hi != "" and int(lo or 0) < int(hi) for lo, hi in _VARIABLE_BRACE.findall(text))
    if not variable(pattern):
        return False
    if len(_split_alternatives(pattern)) > 1:
        return True
    return any(len(alts) > 1 and any(map(variable, alts)) for _, _, alts in _groups(pattern))


def _dropped_constraints(node: dict, where: str) -> list[str]:
    found = []
    if isinstance(node.get("pattern"), str) and alternation_with_bounded_repeat(node["pattern"]):
        found.append(f"pattern with an alternation holding a bounded repeat at {where}")
    if isinstance(node.get("pattern"), str) and optional_group_starting_optional(node["pattern"]):
        found.append(f"pattern with an optional group that starts with an optional atom at {where}")
    if isinstance(node.get("pattern"), str) and optional_group_with_repeated_end(node["pattern"]):
        found.append(f"pattern with an optional group that starts or ends with a repeated atom at {where}")
    names = node.get("properties")
    if isinstance(names, dict) and any('\\' in k or '"' in k or any(ord(c) < 32 for c in k) for k in names):
        found.append(f"property name JSON escapes at {where}")
    siblings = [k for k in _CONSTRAINTS if k in node]
    for comb in ("anyOf", "oneOf", "allOf", "$ref"):
        if comb in node and siblings:
            found.append(f"{comb} beside {', '.join(siblings)} at {where}")
    if isinstance(node.get("oneOf"), list) and len(node["oneOf"]) > 1 and not _disjoint_members(node["oneOf"]):
        found.append(f"oneOf with members that may overlap at {where}")
    ref = node.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        found.append(f"$ref {ref[:60]!r} (not a local JSON pointer) at {where}")
    required, props = node.get("required"), node.get("properties")
    if isinstance(required, list):
        missing = [r for r in required if not (isinstance(props, dict) and r in props)]
        if missing:
            found.append(f"required {', '.join(map(str, missing[:4]))} not in properties at {where}")
    if "type" in node:
        values = ([node["const"]] if "const" in node else []) + (node["enum"] if isinstance(node.get("enum"), list) else [])
        if any(not _matches_type(v, node["type"]) for v in values):
            found.append(f"enum / const values outside type {node['type']} at {where}")
    return found


# Longest run of whitespace allowed between the tokens of a call's arguments (the model and the
# chat template write one space; unbounded, a weak model could fill max_tokens with newlines).
TOOLS_MAX_WHITESPACE = 2


def tools_structural_tag(tools: list[dict], tool_choice: Any = "auto", parallel_tool_calls: bool = True):
    """The xgrammar structural tag for Qwen3-format tool calls.

    Arguments follow the schema's property order: xgrammar 0.2.9's ``any_order=True`` accepts a
    repeated key in place of a missing required one (``{"city": "Paris", "city": "Paris"}`` for
    required ``city`` and ``unit``), which would let schema-breaking output through. Whitespace
    runs inside the arguments are at most :data:`TOOLS_MAX_WHITESPACE` characters.
    """
    import xgrammar as xgr
    return xgr.get_model_structural_tag("qwen_3", tools=tools, tool_choice=tool_choice, reasoning=False,
                                        parallel_tool_calls=parallel_tool_calls,
                                        max_whitespace_cnt=TOOLS_MAX_WHITESPACE)


BACKENDS = ("xgrammar", "llguidance")

# llguidance's JSON options: the layout xgrammar writes with any_whitespace=False ({"a": 1, "b": 2});
# set as overrides, so that a schema's own "x-guidance" cannot turn on `lenient` (which ignores
# keywords llguidance does not implement) or `coerce_one_of` (oneOf compiled as anyOf).
_LLG_JSON = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False,
             "lenient": False, "coerce_one_of": False}
# Formats the JSON Schema drafts define (and `jsonschema`'s format checker knows): a schema with
# one of these goes to llguidance (`unenforced_keywords`). Any other format is an annotation
# (validators ignore it, as xgrammar does) and is dropped for llguidance, which would raise
# "Unknown format"; so is one of these that the schema's draft does not define (`_draft_formats`:
# `color` or `iri` in draft 4) where llguidance would not enforce it (one it enforces, `date` in
# draft 4, stays: stricter than the draft, as users expect). A format of the draft that llguidance
# does not implement (regex, ...) is kept, and llguidance refuses it.
_DEFINED_FORMATS = {"date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname",
                    "ipv4", "ipv6", "uri", "uri-reference", "iri", "iri-reference", "uuid", "uri-template",
                    "json-pointer", "relative-json-pointer", "regex", "color", "host-name", "ip-address"}
# The formats llguidance 1.9 implements (any other raises "Unknown format").
_LLG_FORMATS = frozenset({"date", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "time", "uri", "uuid"})
# Those of each draft (its specification's list), by the draft's first keyword `jsonschema` knows.
_DRAFT4_FORMATS = frozenset({"date-time", "email", "hostname", "ipv4", "ipv6", "uri"})
_DRAFT6_FORMATS = _DRAFT4_FORMATS | {"uri-reference", "uri-template", "json-pointer"}
_DRAFT7_FORMATS = _DRAFT6_FORMATS | {"date", "time", "idn-email", "idn-hostname", "iri", "iri-reference",
                                     "relative-json-pointer", "regex"}
_DRAFT_FORMATS = {"draft3": frozenset({"date-time", "date", "time", "utc-millisec", "regex", "color", "style", "phone",
                                       "uri", "email", "ip-address", "ipv6", "host-name"}),
                  "draft4": _DRAFT4_FORMATS, "draft6": _DRAFT6_FORMATS, "draft7": _DRAFT7_FORMATS,
                  "draft2019-09": _DRAFT7_FORMATS | {"duration", "uuid"},
                  "draft2020-12": _DRAFT7_FORMATS | {"duration", "uuid"}}


def _draft_formats(schema: Any) -> frozenset:
    """The formats ``schema``'s draft defines (its ``$schema``; without one, or one ``jsonschema``
    does not know, 2020-12's), with those ``jsonschema``'s format checker for that draft checks
    (it checks ``regex`` in draft 4, say): any other ``format`` there is an annotation."""
    import warnings

    import jsonschema
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cls = jsonschema.validators.validator_for(schema if isinstance(schema, dict) else {},
                                                  default=jsonschema.Draft202012Validator)
    name = {jsonschema.Draft3Validator: "draft3", jsonschema.Draft4Validator: "draft4",
            jsonschema.Draft6Validator: "draft6", jsonschema.Draft7Validator: "draft7",
            jsonschema.Draft201909Validator: "draft2019-09"}.get(cls, "draft2020-12")
    return _DRAFT_FORMATS[name] | frozenset(cls.FORMAT_CHECKER.checkers)


# Date and time formats as patterns, exact to RFC 3339 as `jsonschema`'s format checker reads it
# (no year 0, days per month with leap years, no leap second, a `Z` / `z` or +hh:mm offset):
# llguidance 1.9's own date-time and time accepted second 60 at any minute ("11:14:60Z").
_YEAR = "([1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_LEAP = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_DATE = (f"({_YEAR}-(0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|{_YEAR}-(0[469]|11)-(0[1-9]|[12][0-9]|30)"
         f"|{_YEAR}-02-(0[1-9]|1[0-9]|2[0-8])|{_LEAP}-02-29)")
_TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]+)?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
# RFC 3986 URI-reference (`jsonschema` checks it with rfc3986-validator's regex), without IP
# literals in brackets (not accepted, so the pattern stays sound): llguidance 1.9 does not
# implement the format and xgrammar 0.2.9's rejected "https://x.org/a".
_PCT = "%[0-9A-Fa-f]{2}"
_PCHAR = f"([A-Za-z0-9._~!$&'()*+,;=:@-]|{_PCT})"
_QUERY = f"([A-Za-z0-9._~!$&'()*+,;=:@/?-]|{_PCT})*"
_AUTHORITY = f"(([A-Za-z0-9._~!$&'()*+,;=:-]|{_PCT})*@)?([A-Za-z0-9._~!$&'()*+,;=-]|{_PCT})*(:[0-9]*)?"
_HIER = f"//{_AUTHORITY}(/{_PCHAR}*)*|/({_PCHAR}+(/{_PCHAR}*)*)?"
_URI = f"[A-Za-z][A-Za-z0-9+.-]*:({_HIER}|{_PCHAR}+(/{_PCHAR}*)*)?"
_RELATIVE = f"({_HIER}|([A-Za-z0-9._~!$&'()*+,;=@-]|{_PCT})+(/{_PCHAR}*)*)?"
_URI_REFERENCE = f"^({_URI}|{_RELATIVE})(\\?{_QUERY})?(#{_QUERY})?$"
# A host name as `jsonschema` checks it (the `fqdn` package, one label at least): labels of 1-63
# letters, digits and hyphens, no hyphen at either end, dot-separated, an optional final dot; the
# name at most 253 characters (written as a maxLength: a 254-character name ending in a dot is
# not produced, the only valid ones left out). llguidance 1.9's own rejected the final dot.
_LABEL = "[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = f"^({_LABEL}\\.)*{_LABEL}\\.?$"
# An e-mail address: RFC 5321's Mailbox with a Dot-string local part (atext runs joined by dots)
# and a domain of host-name labels. `jsonschema` only asks for an "@", so this is stricter
# (sound: every text it takes has one); it leaves out quoted local parts and address literals
# ("[127.0.0.1]"), which a model asked for an e-mail address has no need to write. The class
# escapes & ~ - (the regex syntax llguidance parses reads && ~~ -- in a class as set operations).
_ATEXT = "[A-Za-z0-9!#$%\\&'*+/=?^_`{|}\\~\\-]+"
_EMAIL = f"^{_ATEXT}(\\.{_ATEXT})*@({_LABEL}\\.)*{_LABEL}$"
# `regex`: a regular subset of what Python's re.compile takes (replicas/format_regex.py).
_FORMAT_PATTERNS = {"date": f"^{_DATE}$", "date-time": f"^{_DATE}[Tt]{_TIME}$", "time": f"^{_TIME}$",
                    "uri-reference": _URI_REFERENCE, "hostname": _HOSTNAME, "host-name": _HOSTNAME,
                    "email": _EMAIL, "idn-email": _EMAIL, "regex": REGEX_PATTERN,
                    # the ASCII forms (an RFC 3986 URI is an RFC 3987 IRI; an LDH host name passes
                    # IDNA): stricter than the formats, sound (hypothesis strings drawn from them pass
                    # `jsonschema`'s iri / iri-reference / idn-hostname checkers)
                    "iri": f"^{_URI}(\\?{_QUERY})?(#{_QUERY})?$", "iri-reference": _URI_REFERENCE,
                    "idn-hostname": _HOSTNAME}
_FORMAT_MAX_LENGTH = {"hostname": 253, "host-name": 253, "idn-hostname": 253}


# ECMA-262's \s (WhiteSpace and LineTerminator), which JSON Schema's patterns mean: llguidance's
# regexes read \s as Unicode White_Space, which adds U+0085 and lacks U+FEFF (a grammar sample
# " bF:ed:C2:ed:De:ff\x85" broke ``^\s*(...)\s*$``, bench.grammar_soundness). xgrammar's \s
# is ECMA's already.
_ECMA_SPACE = "\\t\\n\\x0B\\f\\r \u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"


def ecma_whitespace(pattern: str) -> str:
    """``pattern`` with ``\\s`` and ``\\S`` written as ECMA-262's explicit classes
    (:data:`_ECMA_SPACE`), for a regex engine whose ``\\s`` is Unicode's. In a class, ``\\s``
    is inlined; ``[...\\S...]`` becomes ``(?:[...]|[^ws])``.

    Raises:
        ValueError: ``\\S`` inside a negated class (``[^\\S...]``: no regex without look-around
            writes it).
    """
    out, i, n = [], 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            e = pattern[i + 1]
            out.append(f"[{_ECMA_SPACE}]" if e == "s" else f"[^{_ECMA_SPACE}]" if e == "S" else pattern[i:i + 2])
            i += 2
            continue
        if c != "[":
            out.append(c)
            i += 1
            continue
        j, negated, body, non_space = i + 1, False, [], False   # a class: up to its closing ]
        if pattern.startswith("^", j):
            negated, j = True, j + 1
        if pattern.startswith("]", j):   # a leading ] is a member
            body.append("]")
            j += 1
        while j < n and pattern[j] != "]":
            if pattern[j] == "\\" and j + 1 < n:
                e = pattern[j + 1]
                if e == "s":
                    body.append(_ECMA_SPACE)
                elif e == "S":
                    non_space = True
                else:
                    body.append(pattern[j:j + 2])
                j += 2
            else:
                body.append(pattern[j])
                j += 1
        cls = "[" + ("^" if negated else "") + "".join(body) + "]"
        if non_space and negated:
            raise ValueError(f"pattern {pattern[:80]!r}: \\S inside a negated character class (llguidance reads "
                             "\\s as Unicode whitespace, not ECMA-262's)")
        if non_space:
            cls = f"(?:{cls}|[^{_ECMA_SPACE}])" if body else f"[^{_ECMA_SPACE}]"
        out.append(cls)
        i = j + 1
    return "".join(out)


def _llguidance_schema(schema: Any, strict: bool, inline_refs: bool = False, narrowed: list | None = None,
                       mode: str = "exact", split_patterns: bool = False) -> Any:
    """A copy of ``schema`` for llguidance: each ``oneOf`` as an ``anyOf`` where its
    members' overlaps can be negated in keywords llguidance enforces
    (:func:`replicas.schema_oneof.rewrite_one_of`; exact, or narrowed where the module doc says:
    ``"<where>: <what>"`` appended to ``narrowed``), custom (undefined) formats dropped, ``date`` /
    ``date-time`` / ``time`` / ``uri-reference`` / ``hostname`` / ``email`` as patterns (:data:`_FORMAT_PATTERNS`,
    where the node has no ``pattern``); with ``strict``,
    no properties beyond those named (``additionalProperties: false`` where absent, except on
    direct ``allOf`` members, which other members may extend) and no items beyond
    ``prefixItems``, as xgrammar's strict mode. With ``inline_refs`` (a retry where llguidance
    refused recursive references it must intersect), a draft 3 to 7 schema's ``$ref`` siblings
    are removed first (they are ignored there) and such references are inlined last
    (:mod:`replicas.schema_refs`). ``mode``: how far a ``oneOf`` 's negations may be narrowed
    (:func:`replicas.schema_oneof.rewrite_one_of`; retries of :func:`_llguidance_compile` where
    llguidance refused a ``oneOf`` left as it is, or a rewrite too large). With ``split_patterns``
    (a retry where llguidance refused overlapping ``patternProperties``), those are rewritten as
    disjoint ones (:func:`_disjoint_pattern_properties`)."""
    import copy

    from replicas.schema_refs import drop_legacy_ref_siblings, inline_intersected_refs
    schema = copy.deepcopy(schema)
    in_allof = set()
    legacy, formats = _legacy_draft(schema), _draft_formats(schema)
    if inline_refs and legacy:
        drop_legacy_ref_siblings(schema)
    for node, where in _walk(schema):
        if isinstance(node.get("allOf"), list):
            in_allof.update(id(m) for m in node["allOf"])
        fmt = node.get("format")
        if isinstance(fmt, str) and (fmt not in _DEFINED_FORMATS or (
                fmt not in formats and fmt not in _LLG_FORMATS and not (fmt in _FORMAT_PATTERNS and "pattern" not in node))):
            del node["format"]   # an annotation that llguidance would not enforce (it would refuse it)
        if node.get("format") in _FORMAT_PATTERNS and "pattern" not in node:
            fmt = node.pop("format")
            node["pattern"] = _FORMAT_PATTERNS[fmt]
            if fmt in _FORMAT_MAX_LENGTH:
                node["maxLength"] = min(node.get("maxLength", _FORMAT_MAX_LENGTH[fmt]), _FORMAT_MAX_LENGTH[fmt])
        _rewrite_dependencies(node, legacy)
        if strict and id(node) not in in_allof:
            if ("properties" in node or node.get("type") == "object") and "additionalProperties" not in node:
                node["additionalProperties"] = False
            if "prefixItems" in node and "items" not in node:
                node["items"] = False
    _rewrite_keywords(schema)
    from replicas.schema_oneof import rewrite_one_of
    for node, where in [(n, w) for n, w in _walk(schema) if isinstance(n.get("oneOf"), list)]:
        here: list = []
        rewrite_one_of(node, schema, here, mode)   # anyOf where it can be written (else llguidance decides)
        if narrowed is not None:
            narrowed += [f"{where}: {w}" for w in here]
    for node, where in _walk(schema) if split_patterns else ():
        if isinstance(node.get("patternProperties"), dict) and len(node["patternProperties"]) > 1:
            apart = _disjoint_pattern_properties(node)
            if apart and narrowed is not None:
                narrowed.append(f"{where}: patternProperties: a name its patterns match in one regex dialect and "
                                f"not another ({apart[:60]}) is not produced")
    from replicas.regex_complement import explicit_negated_classes
    for node, _ in _walk(schema):   # last: the rewrites above write patterns too
        if isinstance(node.get("pattern"), str):
            node["pattern"] = _llguidance_regex(node["pattern"])
        if isinstance(node.get("pattern"), str) and "[" in node["pattern"]:
            node["pattern"] = explicit_negated_classes(node["pattern"])
        if isinstance(node.get("pattern"), str) and "\\" in node["pattern"]:
            node["pattern"] = ecma_whitespace(node["pattern"])
        if isinstance(node.get("patternProperties"), dict):
            renamed = {ecma_whitespace(explicit_negated_classes(k) if "[" in k else k): v
                       for k, v in ((_llguidance_regex(k), v) for k, v in node["patternProperties"].items())}
            if len(renamed) == len(node["patternProperties"]):   # (two patterns written alike: left)
                node["patternProperties"] = renamed
    if inline_refs:
        inline_intersected_refs(schema)
    return schema


def _disjoint_pattern_properties(node: dict) -> str | None:
    """``node``'s ``patternProperties`` rewritten, in place, where two may match one name
    (llguidance refuses overlapping patterns), so that each name gets what JSON Schema asks of it
    (the ``allOf`` of the schemas of every pattern that matches it, beside its ``properties``
    entry). A pattern that matches every name (``.*``) becomes ``additionalProperties`` (which it
    leaves unused), its schema added to every other pattern's and to every declared property's
    (with those of the patterns that match the name); otherwise the patterns are split into
    disjoint regions (:func:`replicas.regex_complement.disjoint_regions`), a name the patterns'
    dialects (Python's, ECMA-262's) read differently not allowed (``false``). Returns the regex of
    those names (None where there is none, or the patterns are left as they are: disjoint
    already, or past the bounds)."""
    from replicas.regex_complement import (Unsupported, disjoint_regions, matches_everything, reads_alike,
                                          search_in_every_reading)
    patterns = list(node["patternProperties"])
    schemas = [node["patternProperties"][p] for p in patterns]
    every = [i for i, p in enumerate(patterns) if matches_everything(p)]
    others = [i for i in range(len(patterns)) if i not in every]
    if every and len(others) <= 1 and all(reads_alike(patterns[i]) for i in others):
        regions, apart = [(patterns[i], (0,)) for i in others], None   # (the other as written)
    else:
        try:
            regions, apart = disjoint_regions(tuple(patterns[i] for i in others)) if others else ([], None)
        except (Unsupported, ValueError):
            return None
    if not every and all(len(group) == 1 for _, group in regions):
        return None   # (disjoint already: left to llguidance as they are)
    if every:
        props = node.get("properties", {})
        if not isinstance(props, dict):
            return None
        every_schema = schemas[every[0]] if len(every) == 1 else {"allOf": [schemas[i] for i in every]}
        folded = {}
        for name, schema in props.items():
            found = [search_in_every_reading(patterns[i], name) for i in others]
            if None in found:
                return None
            folded[name] = {"allOf": [schema, every_schema] + [schemas[i] for i, f in zip(others, found) if f]}
        if apart is None and all(len(g) == 1 for _, g in regions):   # the others as they are written
            out = {patterns[i]: {"allOf": [schemas[i], every_schema]} for i in others}
        else:   # (a name read differently: every other pattern's schema, stricter than JSON Schema asks)
            out = {rx: {"allOf": [schemas[others[i]] for i in g] + [every_schema]} for rx, g in regions}
            if apart is not None:
                out[apart] = {"allOf": [schemas[i] for i in others] + [every_schema]}
        node["patternProperties"] = out
        node["additionalProperties"] = every_schema
        if props:
            node["properties"] = folded
        return None
    out = {rx: schemas[others[g[0]]] if len(g) == 1 else {"allOf": [schemas[others[i]] for i in g]}
           for rx, g in regions}
    if apart is not None:
        out[apart] = False
    node["patternProperties"] = out
    return apart


def _class_literals(pattern: str) -> str:
    """``pattern`` with the characters a ``[...]`` class holds literally in Python and ECMA-262
    but Rust's regex syntax (llguidance's) reads as class syntax escaped: a ``[`` inside a class
    (Rust: a nested class; ``[[a-z]*]`` is another language there), ``&&`` and ``~~`` (Rust:
    intersection, symmetric difference), and the second ``-`` of ``X--`` (Python and ECMA-262:
    the range from ``X`` to ``-``; Rust: set difference, which took ``‒``, ``§``, ``[`` out of a
    JSONSchemaBench class ``[... "--\xad‐‑‒ ...]``, stop 45)."""
    out, i, n, in_class = [], 0, len(pattern), False
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if not in_class:
            if c == "[":
                in_class = True
                out.append(c)
                i += 1
                if i < n and pattern[i] == "^":
                    out.append("^")
                    i += 1
                if i < n and pattern[i] == "]":   # a first "]" is a literal
                    out.append("\\]")
                    i += 1
                continue
            out.append(c)
        elif c == "]":
            in_class = False
            out.append(c)
        elif c == "[" or c in "&~" and pattern[i + 1:i + 2] == c:
            out.append("\\" + c)
        elif c == "-" and pattern[i + 1:i + 2] == "-" and out[-1] not in ("[", "^"):
            out.append("-\\-")   # X--: the range from X to "-"
            i += 1
        else:
            out.append(c)
        i += 1
    return "".join(out)


def _llguidance_regex(pattern: str) -> str:
    """``pattern`` as llguidance's regex engine reads it right: ``\\<`` / ``\\>`` (literal
    ``<`` / ``>`` in Python and ECMA-262, word boundaries in Rust's) written plain; look-aheads
    after ``^`` and anchors inside the pattern (which it refuses) written out on automata
    (:func:`replicas.regex_complement.without_lookaheads` / ``without_inner_anchors``) where
    they can be; else unchanged (and llguidance refuses what it cannot read)."""
    import re as _re

    from replicas.regex_complement import Unsupported, inner_anchors, lookaheads, without_inner_anchors, without_lookaheads
    pattern = _class_literals(_re.sub(r"(?<!\\)((?:\\\\)*)\\([<>])", r"\1\2", pattern))
    try:
        if lookaheads(pattern):
            return without_lookaheads(pattern)
        if inner_anchors(pattern):   # ("^(a|$)": llguidance reads an anchor inside as a look-around)
            return without_inner_anchors(pattern)
    except Unsupported:
        pass
    return pattern


_REWRITTEN = ("not", "if", "then", "else", "uniqueItems", "propertyNames")


def _rewrite_keywords(schema: Any) -> None:
    """``not``, ``if`` / ``then`` / ``else``, ``uniqueItems``, ``propertyNames`` in keywords
    llguidance enforces, in place, where that can be written exactly (``replicas/schema_not.py``,
    ``replicas/schema_collections.py``); the others are left (llguidance refuses them). Finite
    ``patternProperties`` of a closed object become declared names (each then written once)."""
    from replicas.schema_collections import (drop_properties_patterns_cover, rewrite_finite_pattern_properties,
                                             rewrite_property_names, rewrite_unique_items)
    from replicas.schema_not import rewrite_all, rewrite_if, rewrite_if_chain, rewrite_not
    rewrite_all(schema, _walk, (rewrite_if, rewrite_not, rewrite_unique_items, rewrite_property_names,
                                rewrite_finite_pattern_properties, drop_properties_patterns_cover),
                (rewrite_if_chain,))


def _legacy_draft(schema: Any) -> bool:
    """Whether ``jsonschema`` reads ``schema`` as draft 3 to 7 (its ``$schema``; without one, or
    with one it does not know, as 2020-12): those have ``dependencies``, the later drafts
    ``dependentRequired`` / ``dependentSchemas`` instead (each ignores the other's keywords)."""
    import jsonschema
    if not isinstance(schema, dict) or not isinstance(schema.get("$schema"), str):
        return False
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # an unknown $schema: jsonschema warns and uses 2020-12
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return "dependencies" in cls.VALIDATORS


def _rewrite_dependencies(node: dict, legacy: bool = False) -> None:
    """Replace ``dependentRequired`` / ``dependentSchemas`` / draft-4 ``dependencies`` (which
    llguidance does not implement) by what they mean, in keywords it does (only those of the
    schema's draft, ``legacy``: draft 3 to 7 has ``dependencies``, later drafts the other two; the
    other draft's are removed, as validators ignore them): for each key ``k``,
    ``anyOf: [{properties: {k: false}}, {required: [k, ...]} or {allOf: [{required: [k]}, S]}]``
    (``k`` absent, or present with what it needs), added to the node's ``allOf``."""
    extra = []
    for kw in ("dependentRequired", "dependentSchemas", "dependencies"):
        deps = node.get(kw)
        if not isinstance(deps, dict):
            continue
        del node[kw]
        if (kw == "dependencies") != legacy:
            continue   # not a keyword of the schema's draft: validators ignore it
        for k, need in deps.items():
            if isinstance(need, str):   # draft 3: one name
                need = [need]
            present = {"required": [k, *need]} if isinstance(need, list) else {"allOf": [{"required": [k]}, need]}
            extra.append({"anyOf": [{"properties": {k: False}}, present]})
    if extra:
        node["allOf"] = (node["allOf"] if isinstance(node.get("allOf"), list) else []) + extra


_PROSE_WORDS = ("not", "if", "then", "else")


def _places(schema: Any, message: str) -> list[str]:
    """Where ``schema`` uses the keywords llguidance's error ``message`` names (its messages say
    which keyword, not where): the places :func:`unenforced_keywords` lists, plus any node
    holding a keyword named in "Unimplemented keys: [...]" or the format in "Unknown format: X"."""
    keys = re.search(r"Unimplemented keys: \[([^\]]*)\]", message)
    named = set(re.findall(r'"([$\w]+)"', keys.group(1))) if keys else set()
    fmt = re.search(r"Unknown format: (\S+)", message)
    words = {p.split(" ", 1)[0] for p in unenforced_keywords(schema)}
    if "regex" in message:
        message += " pattern"      # a regex llguidance's parser refused is a pattern's
    if "Resource" in message:
        message += " $ref"         # a $ref it could not resolve
    def named_in(word: str) -> bool:   # "not", "if", ...: as a key llguidance names, not its prose ("not supported")
        return f'"{word}"' in message if word in _PROSE_WORDS else word in message
    found = [p for p in unenforced_keywords(schema) if named_in(p.split(" ", 1)[0]) and p.split(" ", 1)[0] in words]
    for node, where in _walk(schema):
        found += [f"{k} at {where}" for k in sorted(named) if k in node and f"{k} at {where}" not in found]
        if fmt and node.get("format") == fmt.group(1):
            found.append(f"format {fmt.group(1)} at {where}")
    if any(p.split(" ", 1)[0] in _REWRITTEN for p in found):   # only those the rewrites left
        import copy
        left = copy.deepcopy(schema)
        _rewrite_keywords(left)
        left = {f"{k} at {where}" for node, where in _walk(left) for k in _REWRITTEN if k in node}
        found = [p for p in found if p.split(" ", 1)[0] not in _REWRITTEN or p in left] or found
    return found


def _tool_schemas(v: dict) -> list[tuple[str, Any]]:
    return [(t.get("function", {}).get("name"), t.get("function", {}).get("parameters")) for t in v.get("tools") or []]


def backend_for(spec: GrammarSpec) -> str:
    """Which backend compiles ``spec`` (a spec :func:`_check` returned): xgrammar unless the spec
    uses something xgrammar does not enforce. Raises nothing; a spec llguidance cannot enforce
    either is refused when llguidance compiles it."""
    if spec.kind == "json_schema":
        return "llguidance" if unenforced_keywords(spec.value) or incomplete_keywords(spec.value) else "xgrammar"
    if spec.kind == "tools":
        if spec.value.get("tool_choice", "auto") == "none":
            return "xgrammar"  # free text: no argument schema takes part
        return "llguidance" if any(unenforced_keywords(p) for _, p in _tool_schemas(spec.value)) else "xgrammar"
    if spec.kind == "lark":
        return "llguidance"   # its native syntax (xgrammar's from_lark takes a subset)
    if spec.kind == "regex" and (_LOOKAROUND.search(spec.value) or optional_group_starting_optional(spec.value)
                                 or optional_group_with_repeated_end(spec.value)):
        return "llguidance"   # xgrammar ignores look-around and mis-compiles such groups; llguidance refuses look-around
    return "xgrammar"


def fallback_for(spec: GrammarSpec) -> str | None:
    """The backend that compiles a json_schema ``spec`` when :func:`backend_for`'s choice refuses
    it, or None: xgrammar for a schema sent to llguidance only for completeness
    (:func:`incomplete_keywords`; xgrammar enforces all of it, but rejects some valid instances);
    llguidance for a schema sent to xgrammar whose compiler refuses it for a limit of its own (a
    bound past what its integer ranges hold: ``"maximum": 9223372036854776000``), never after the
    time or memory bound (:class:`GrammarCompileLimitError`), and where llguidance refuses it too
    the refusal is xgrammar's. llguidance refuses what it does not enforce, so either way the
    schema is served whole or refused."""
    if spec.kind != "json_schema" or unenforced_keywords(spec.value):
        return None
    return "xgrammar" if incomplete_keywords(spec.value) else "llguidance"


def _lark_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def tools_lark(tools: list[dict], tool_choice: Any = "auto", parallel_tool_calls: bool = True,
               special: frozenset = frozenset()) -> str:
    """A Lark grammar (llguidance) accepting what :func:`tools_structural_tag` accepts: Qwen3
    ``<tool_call>`` blocks with each tool's arguments under its schema (llguidance's ``%json``),
    free text outside them for ``auto`` (text never containing ``<tool_call>``, ``<think>`` or
    ``</think>``), at least one call first for ``required`` / a named tool, one call at most
    without ``parallel_tool_calls``. ``special``: the tags that are special tokens of the tokenizer
    (referenced as ``<tag>``, which text cannot spell)."""
    if isinstance(tool_choice, dict):
        name = tool_choice.get("function", {}).get("name")
        tools = [t for t in tools if t.get("function", {}).get("name") == name]
        if not tools:
            raise GrammarCompileError(f"tool_choice names {name!r}, which is not among the tools")
        tool_choice, parallel_tool_calls = "required", False   # one call of that tool, as xgrammar's

    def tag(t):
        return f"<{t[1:-1]}>" if t in special else _lark_str(t)
    rules, alts = [], []
    for i, t in enumerate(tools):
        fn = t.get("function", {})
        params = fn.get("parameters") or {"type": "object"}
        schema = _llguidance_schema(params, strict=False)
        if isinstance(schema, dict):
            schema["x-guidance"] = _LLG_JSON
        begin = "\n" + json.dumps({"name": fn.get("name")}, ensure_ascii=False)[:-1] + ', "arguments": '
        rules.append(f'call_{i}: {tag("<tool_call>")} {_lark_str(begin)} args_{i} {_lark_str("}" + chr(10))} '
                     f'{tag("</tool_call>")}')
        rules.append(f"args_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
        alts.append(f"call_{i}")
    start = {("auto", True): "TEXT (call TEXT)*", ("auto", False): "TEXT | TEXT call",
             ("required", True): "call (TEXT call)* TEXT", ("required", False): "call"}[
        (tool_choice, bool(parallel_tool_calls))]
    text = "TEXT: /(?s:.*)/ & ~/(?s:.*(<tool_call>|<think>|<\\/think>).*)/"
    return "\n".join(["%llguidance {}", f"start: {start}", f"call: {' | '.join(alts)}", text] + rules) + "\n"


def _llguidance_grammar(spec: GrammarSpec, special: frozenset = frozenset()) -> str:
    """The llguidance grammar (its JSON form) for a spec :func:`_check` returned."""
    import llguidance as llg
    v = spec.kind, spec.value
    if spec.kind == "json_schema":
        return _llguidance_json_grammar(spec)[0]
    if spec.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "lark":
        return llg.LLMatcher.grammar_from_lark(spec.value)
    if spec.kind == "tools":
        v = spec.value
        return llg.LLMatcher.grammar_from_lark(tools_lark(v["tools"], v.get("tool_choice", "auto"),
                                                          v.get("parallel_tool_calls", True), special))
    raise GrammarCompileError(f"no llguidance route for a {spec.kind} grammar")  # backend_for never asks


def _llguidance_json_grammar(spec: GrammarSpec, inline_refs: bool = False, mode: str = "exact",
                            split_patterns: bool = False) -> tuple[str, frozenset, tuple]:
    """(llguidance grammar text, the paths of the unique arrays left to the
    matcher: :func:`replicas.decode_checks.remove_checked`, what was narrowed: see
    :func:`_llguidance_schema`) for a json_schema spec; the options: see :func:`_llguidance_schema`."""
    import llguidance as llg

    from replicas.decode_checks import remove_checked
    narrowed: list = []
    schema = _llguidance_schema(spec.value, spec.strict, inline_refs, narrowed, mode, split_patterns)
    text = json.dumps(schema)
    checked = '"uniqueItems"' in text or '"minProperties"' in text or '"maxProperties"' in text
    paths = (remove_checked(schema) or frozenset()) if checked else frozenset()
    return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=_LLG_JSON), paths, tuple(narrowed)


def _llguidance_refusal(spec: GrammarSpec, message: str) -> str:
    """The refusal for a spec llguidance did not compile: what, where, and llguidance's words."""
    message = _clean(message)
    if spec.kind == "json_schema":
        where = _places(spec.value, message)
        return (f"the schema uses JSON Schema keywords the grammar backends cannot enforce "
                f"(xgrammar drops them, llguidance refuses them): {'; '.join(sorted(where)[:8]) or 'what llguidance names'} "
                f"(llguidance: {message[:300]})")
    if spec.kind == "tools":
        for name, params in _tool_schemas(spec.value):
            where = _places(params, message)
            if where:
                return (f"tool {name!r} uses JSON Schema keywords the grammar backends cannot enforce: "
                        f"{'; '.join(sorted(where)[:8])} (llguidance: {message[:300]})")
        return f"the tools grammar cannot be enforced (llguidance: {message[:300]})"
    return f"invalid {spec.kind} grammar: {message[:400]}"


_UPPER_BOUNDS, _LOWER_BOUNDS = ("maximum", "exclusiveMaximum"), ("minimum", "exclusiveMinimum")
_I64_INNER = math.nextafter(2.0**63, 0)   # the largest double below 2**63 (2**63 - 1024)


def _inner_double(v: int, upper: bool) -> int:
    """The integer-valued double nearest ``v`` on its inner side (at most ``v`` for an ``upper``
    bound, at least ``v`` for a lower one) and strictly within +-2**63, as an int."""
    try:
        d = float(v)
    except OverflowError:
        d = math.copysign(sys.float_info.max, v)
    if (d > v) if upper else (d < v):
        d = math.nextafter(d, -math.inf if upper else math.inf)
    if upper and d > _I64_INNER:
        d = _I64_INNER
    if not upper and d < -_I64_INNER:
        d = -_I64_INNER
    return int(d)


def _exact_bounds(schema: Any) -> Any:
    """``schema`` with every integer bound that no double holds, or that is past a 64-bit integer,
    moved inward to the nearest double within +-2**63: upper bounds down, lower bounds up (a copy;
    ``schema`` itself when there is none). Both backends read a bound as a double (llguidance took
    9007199254740996 under ``"maximum": 9007199254740995``), while ``jsonschema`` compares exact
    Python ints; and neither builds a range at 2**63 (xgrammar: "Integer exceeds maximum limit";
    llguidance: "Failed to generate regex for integer range", for a common ``"maximum":
    9223372036854775807``). The moved bound is read exactly, and every instance within it is
    within the original (sound; the integers between the two bounds, 1,024 at most below 2**63,
    are not produced)."""
    def inexact(node):
        return [k for k in _UPPER_BOUNDS + _LOWER_BOUNDS if type(node.get(k)) is int and abs(node[k]) > 2**53
                and _inner_double(node[k], k in _UPPER_BOUNDS) != node[k]]
    if not any(inexact(node) for node, _ in _walk(schema)):
        return schema
    import copy
    schema = copy.deepcopy(schema)
    for node, _ in _walk(schema):
        for k in inexact(node):
            node[k] = _inner_double(node[k], k in _UPPER_BOUNDS)
    return schema


def _check(spec: GrammarSpec) -> GrammarSpec:
    """What the compiler refuses before compiling (malformed input; what no backend enforces is
    refused when llguidance compiles it, see :func:`backend_for`). Returns the spec to compile (a json_schema
    given as text comes back parsed, so the compiler process does not parse and check it again)."""
    v = spec.value
    if spec.kind == "json_schema":
        parsed = v
        if isinstance(v, str):
            try:
                parsed = json.loads(v)
            except json.JSONDecodeError as e:
                raise GrammarCompileError(f"invalid json_schema grammar: not valid JSON: {e}") from None
        return GrammarSpec("json_schema", _exact_bounds(parsed), spec.strict)
    if spec.kind == "choice" and (not v or not isinstance(v, list) or not all(isinstance(x, str) for x in v)):
        raise GrammarCompileError("choice needs a non-empty list of strings")
    if spec.kind in ("ebnf", "lark", "regex") and (not isinstance(v, str) or not v.strip()):
        raise GrammarCompileError(f"a {spec.kind} grammar needs non-empty text")
    if spec.kind == "tools":
        tools = (v or {}).get("tools") or []
        if not tools:
            raise GrammarCompileError("a tools grammar needs at least one tool")
        params = [(t.get("function") or {}).get("parameters") if isinstance(t, dict) else None for t in tools]
        exact = [_exact_bounds(p) for p in params]
        if any(e is not p for e, p in zip(exact, params)):
            tools = [t if e is p else {**t, "function": {**t["function"], "parameters": e}}
                     for t, p, e in zip(tools, params, exact)]
            return GrammarSpec("tools", {**v, "tools": tools}, spec.strict)
    return spec


def _compile_with(compiler, spec: GrammarSpec):
    """Compile a spec :func:`_check` returned, with an ``xgrammar.GrammarCompiler``."""
    v = spec.value
    if spec.kind == "json_schema":
        return compiler.compile_json_schema(json.dumps(v), any_whitespace=False, strict_mode=spec.strict)
    if spec.kind == "json_object":
        return compiler.compile_builtin_json_grammar()
    if spec.kind == "regex":
        return compiler.compile_regex(v)
    if spec.kind == "choice":
        return compiler.compile_regex("|".join(re.escape(x) for x in v))
    if spec.kind == "ebnf":
        return compiler.compile_grammar(v)
    if spec.kind == "lark":
        import xgrammar as xgr
        return compiler.compile_grammar(xgr.Grammar.from_lark(v))
    tag = tools_structural_tag(v["tools"], v.get("tool_choice", "auto"), v.get("parallel_tool_calls", True))
    return compiler.compile_structural_tag(tag)


@functools.lru_cache(maxsize=1)
def _libc():
    import ctypes
    return ctypes.CDLL("libc.so.6")


def _trim_heap() -> None:
    """Hand freed heap memory back to the OS (glibc ``malloc_trim``). Deserializing a large
    grammar allocates and frees hundreds of MB in small blocks that glibc otherwise keeps: without
    it a process that deserialized 60 Github_hard grammars (none kept) held 2.4 GiB, with it 0.5."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _clean(message: str) -> str:
    """xgrammar's message without its log prefix (time, C++ source file and line)."""
    return " ".join(re.sub(r"\[\d\d:\d\d:\d\d\] \S+:\d+: ", "", message).split())


class Matcher:
    """One request's grammar state, whichever backend compiled the grammar.

    Token ids index the model's vocabulary. ``accept_token`` leaves the state unchanged when it
    refuses a token (both backends); ``rollback(n)`` undoes the last ``n`` accepted tokens;
    ``is_terminated`` is True once a stop token (the tokenizer's EOS) was accepted;
    ``find_jump_forward_string`` is the text every continuation starts with ("" if none). The
    batch bitmask is filled by :meth:`GrammarCompiler.apply_bitmask`, which reads ``native``.
    """
    backend: str = ""
    native: Any = None

    def accept_token(self, token: int) -> bool:
        raise NotImplementedError

    def accept_string(self, text: str) -> bool:
        """Accept ``text`` whole (xgrammar: by bytes; llguidance: its tokens), or nothing."""
        raise NotImplementedError

    def rollback(self, num_tokens: int) -> None:
        raise NotImplementedError

    def is_terminated(self) -> bool:
        raise NotImplementedError

    def find_jump_forward_string(self) -> str:
        raise NotImplementedError


class XGrammarMatcher(Matcher):
    backend = "xgrammar"

    def __init__(self, compiled):
        import xgrammar as xgr
        self.native = xgr.GrammarMatcher(compiled)

    def accept_token(self, token: int) -> bool:
        return self.native.accept_token(token)

    def accept_string(self, text: str) -> bool:
        return self.native.accept_string(text)

    def rollback(self, num_tokens: int) -> None:
        self.native.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.native.is_terminated()

    def find_jump_forward_string(self) -> str:
        return self.native.find_jump_forward_string()


@dataclass
class LLGuidanceGrammar:
    """A grammar llguidance compiled: its JSON form and a matcher in the start state, which
    :class:`LLGuidanceMatcher` copies (``LLMatcher.deep_copy``) instead of rebuilding."""
    grammar: str
    template: Any
    tokenizer: Any  # the llguidance.LLTokenizer
    checked_paths: frozenset = frozenset()   # keywords checked on the text while decoding (replicas/decode_checks.py)
    narrowed: tuple = ()   # "<where>: <what>" for each oneOf negation written for part of its instances

    @property
    def memory_size_bytes(self) -> int:
        return len(self.grammar)


class LLGuidanceMatcher(Matcher):
    """llguidance's ``LLMatcher`` behind :class:`Matcher`. A stop token is accepted (and never
    passed to llguidance) when the matcher is in an accepting state: llguidance refuses EOS once
    its grammar cannot extend (a finished ``choice``), where xgrammar accepts it."""
    backend = "llguidance"

    def __init__(self, compiled: LLGuidanceGrammar):
        self.native = compiled.template.deep_copy()
        self._tok = compiled.tokenizer
        self._stop = set(compiled.tokenizer.eos_tokens)
        self._terminated = False
        self.masked = False   # the mask of the current state is computed (set by apply_bitmask)

    def accept_token(self, token: int) -> bool:
        """Accept ``token`` if the grammar allows it (False, state unchanged, if not).

        The token is checked against the state's mask, computed here when the step did not
        (tests, drafts, forced strings): llguidance's ``validate_tokens`` on a state whose mask
        was never computed walks its lexer another way, which on some patterns (Github_hard
        #102: ``^(?:\\S+\\s+){0,29}\\S+$`` with ``maxLength`` 300) builds regex derivatives
        until its lexer gives up ("too many expressions constructed"), refusing valid text, and
        leaves the grammar's shared lexer unusable for every later matcher."""
        if self._terminated or self.native.is_error():
            return False
        if token in self._stop:
            self._terminated = self.native.is_accepting()
            return self._terminated
        if not self.masked:
            self.native.compute_bitmask()
        # llguidance enters a permanent error state on a refused token: check first.
        if self.native.validate_tokens([token]) != 1:
            return False
        self.masked = False
        return self.native.consume_token(token)

    def accept_string(self, text: str) -> bool:
        ids = self._tok.tokenize_str(text)
        if self._terminated or self.native.is_error():
            return False
        for k, token in enumerate(ids):   # one token at a time, each against its state's mask
            if token in self._stop or not self.accept_token(token):
                self.rollback(k)
                return False
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.masked = False
        if num_tokens and self._terminated:
            self._terminated, num_tokens = False, num_tokens - 1
        if num_tokens and not self.native.rollback(num_tokens):
            raise RuntimeError(f"llguidance could not roll back {num_tokens} tokens: {self.native.get_error()}")

    def is_terminated(self) -> bool:
        return self._terminated

    def find_jump_forward_string(self) -> str:
        if self._terminated or self.native.is_error() or self.native.is_stopped():
            return ""
        return self.native.compute_ff_bytes().decode("utf-8", errors="ignore")  # an incomplete last char stays out


def _llguidance_tokenizer(tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """(llguidance.LLTokenizer, the Qwen3 tool tags that are special tokens) for a HF tokenizer."""
    import llguidance.hf
    tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(stop_token_ids))
    special = set()
    for t in ("<tool_call>", "</tool_call>"):
        i = tokenizer.convert_tokens_to_ids(t)
        if isinstance(i, int) and i != tokenizer.unk_token_id and tok.is_special_token(i):
            special.add(t)
    return tok, frozenset(special)


def _llguidance_compile(tok, special: frozenset, spec: GrammarSpec, grammar: str | None = None,
                        checked_paths: frozenset = frozenset(), narrowed: tuple = ()) -> LLGuidanceGrammar:
    """Build and check an llguidance matcher for ``spec`` (or for ``grammar``, its JSON form,
    already built), computing its first mask so that lazy errors surface here.

    Raises:
        GrammarCompileError: llguidance refused the grammar (its message, with where for schemas).
    """
    import llguidance as llg

    def build(**options):
        nonlocal grammar, checked_paths, narrowed
        try:
            if grammar is None and spec.kind == "json_schema":
                grammar, checked_paths, narrowed = _llguidance_json_grammar(spec, **options)
            grammar = grammar or _llguidance_grammar(spec, special)
        except ValueError as e:
            return None, str(e)
        m = llg.LLMatcher(tok, grammar, log_level=0, limits=llg.LLParserLimits(**LLG_LIMITS))
        if not m.is_error():
            m.compute_bitmask()
        return (None, m.get_error()) if m.is_error() else (m, "")

    # Where llguidance refuses a schema's rewrite, it is rewritten again with the option its
    # message asks for, until none is left: recursive references it must intersect inlined,
    # overlapping patternProperties made disjoint, oneOf negations narrowed further
    # (replicas/schema_oneof.py, "Narrowing").
    retry = grammar is None and spec.kind == "json_schema"
    options = {"inline_refs": False, "split_patterns": False, "mode": "exact"}
    m, error = build(**options)
    while m is None and retry:
        if _CIRCULAR in error and not options["inline_refs"]:
            options["inline_refs"] = True
        elif _OVERLAPPING_PATTERNS in error and not options["split_patterns"]:
            options["split_patterns"] = True
        elif (_ONE_OF in error or any(w in error for w in _TOO_LARGE)) and options["mode"] != "required":
            options["mode"] = "partial" if options["mode"] == "exact" else "required"
        else:
            break
        grammar = None
        m, error = build(**options)
    if m is None:
        raise GrammarCompileError(_llguidance_refusal(spec, error))
    return LLGuidanceGrammar(grammar, m, tok, checked_paths, narrowed)


# llguidance's parser limits: its default of 2,000 Earley items in a row stopped JsonSchemaStore
# #447 mid-output ("ParserTooComplex": 2,369 items where a oneOf rewritten as anyOf branches is
# predicted, which the compile-time first mask does not reach); the work per step stays bounded
# by `step_max_items` (50,000, llguidance's default).
LLG_LIMITS = {"max_items_in_row": 10_000}
_CIRCULAR = "circular references with sibling keys"   # llguidance's words (replicas/schema_refs.py)
# llguidance's words where its intersections multiplied out past its bounds (the second, a panic
# it reports: more grammar symbols than its 16-bit ids hold; Github_ultra #18 rewritten "partial")
_TOO_LARGE = ("schema too large", "grammar.symbols.len() < u16::MAX")
_OVERLAPPING_PATTERNS = "patternProperty regexes"   # llguidance's words ("are not disjoint", "can't determine if")
_ONE_OF = "oneOf constraints are not supported"   # llguidance's words for a oneOf it cannot prove disjoint


def _compile_worker(info_json: str, llg_args: tuple, conn) -> None:
    """The compiler process: compile ``(backend, spec)`` s from ``conn`` and send back xgrammar's
    serialized grammar or llguidance's checked grammar text."""
    import xgrammar as xgr
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(info_json), max_threads=1)
    llg_tok = None
    while True:
        try:
            backend, spec = conn.recv()
        except EOFError:
            return
        try:
            if backend == "xgrammar":
                conn.send(("ok", _compile_with(compiler, spec).serialize_json()))
            else:
                llg_tok = llg_tok or _llguidance_tokenizer(*llg_args)
                compiled = _llguidance_compile(*llg_tok, spec)
                conn.send(("ok", (compiled.grammar, compiled.checked_paths, compiled.narrowed)))
        except GrammarCompileError as e:
            conn.send(("refused", str(e)))
        except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own types
            conn.send(("error", str(e)))


class GrammarCompiler:
    """Compiles :class:`GrammarSpec` s for one tokenizer, in a child process, with a cache, with
    the backend :func:`backend_for` picks (xgrammar or llguidance, the same bounds for both).

    Compilation runs in a separate process (``isolate=True``) that is killed and replaced when it
    passes ``timeout_s``, dies or holds more than ``memory_bytes`` of resident memory: a schema that crashes, hangs or
    explodes the compiler costs its request a :class:`GrammarCompileError`, never the replica. The
    compiled grammar comes back serialized (xgrammar's JSON form; for llguidance its checked
    grammar text, from which this process builds one start-state matcher that each request's
    matcher copies). Compiled grammars are cached
    by spec, least recently used first out, within ``cache_bytes``, each counted by the size of
    its serialized form: a deserialized grammar held about 0.8x that, while xgrammar's
    ``memory_size_bytes`` said 20-60x less (Github_hard schemas: 0.2-2.7 MB reported for grammars
    of 0.8-161 MB serialized), and a replica counting by it grew to 6 GiB and was killed by the
    node's memory monitor.

    Args:
        tokenizer: the Hugging Face tokenizer of the model.
        vocab_size: the model's logits width (may exceed the tokenizer's size).
        timeout_s: compilation time bound; past it :class:`GrammarCompileError` is raised.
        isolate: compile in the child process (False: in a thread of this process, where a hung
            compilation cannot be stopped; for tools that compile many grammars in one process).
        memory_bytes: resident-memory bound of the compiler process, watched while it compiles
            (3 GiB; the process holds about 0.5 GiB after importing xgrammar). Without a bound one
            JSONSchemaBench schema (Github_hard #86) exhausted a 24 GiB node and Ray killed the
            replica; an address-space cap instead refused most Github_ultra schemas (thread
            stacks and allocator arenas count there).
        cache_bytes: bound of the compiled-grammar cache.
    """

    def __init__(self, tokenizer, vocab_size: int, timeout_s: float = 10.0, max_threads: int = 2,
                 isolate: bool = True, memory_bytes: int = 3 << 30, cache_bytes: int = 256 << 20):
        import collections
        import threading

        import xgrammar as xgr
        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.timeout_s, self.vocab_size, self.isolate = timeout_s, vocab_size, isolate
        self.memory_bytes, self.cache_bytes = memory_bytes, cache_bytes
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()
        self._proc = self._conn = None
        self._bitmask = self._batch = self._executor = None   # the reused batch bitmask, xgrammar / llguidance batch fillers
        self.max_threads = max_threads
        self._tokenizer = tokenizer
        self._llg = None   # (llguidance.LLTokenizer, special tool tags), built on first use
        if not isolate:
            self.compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads)
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")

    # ------------------------------------------------------------------ the compiler process
    def _start(self) -> None:
        import multiprocessing as mp

        from replicas.spawn import start_without_main
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        llg_args = (self._tokenizer, self.vocab_size, list(self.info.stop_token_ids))
        self._proc = ctx.Process(target=_compile_worker, args=(self.info.serialize_json(), llg_args, child),
                                 daemon=True, name="grammar-compiler")
        start_without_main(self._proc)
        child.close()

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(timeout=5)
        self._proc = self._conn = None

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _rss(self) -> int:
        """Resident memory of the compiler process, bytes (0 if it cannot be read)."""
        import psutil
        try:
            return psutil.Process(self._proc.pid).memory_info().rss
        except (psutil.Error, AttributeError):
            return 0

    @property
    def llg(self):
        """(llguidance.LLTokenizer, the tool tags that are special tokens) of this tokenizer."""
        if self._llg is None:
            self._llg = _llguidance_tokenizer(self._tokenizer, self.vocab_size, list(self.info.stop_token_ids))
        return self._llg

    def _compile_isolated(self, backend: str, spec: GrammarSpec):
        started = self._proc is None or not self._proc.is_alive()
        if started:
            self._start()
        self._conn.send((backend, spec))
        # A fresh process first imports xgrammar: that wait is not the grammar's.
        deadline = time.monotonic() + self.timeout_s + (60 if started else 0)
        while not self._conn.poll(0.05):
            if time.monotonic() > deadline:
                self._stop()
                raise GrammarCompileLimitError(f"{spec.kind} grammar did not compile within {self.timeout_s:g} s")
            if self._rss() > self.memory_bytes:
                self._stop()
                raise GrammarCompileLimitError(f"{spec.kind} grammar needs more than the compiler's "
                                          f"{self.memory_bytes / 2**30:g} GiB of memory")
        try:
            status, payload = self._conn.recv()
        except (EOFError, OSError):
            self._stop()
            raise GrammarCompileLimitError(f"the grammar compiler died on this {spec.kind} grammar") from None
        if (status != "ok" and "bad_alloc" in str(payload)) or self._rss() > self.memory_bytes // 2:
            # The process keeps what it grew to: a fresh one, so that the next grammar is not
            # refused for memory a previous one took.
            self._stop()
        if status == "refused":
            raise GrammarCompileError(payload)
        if status != "ok":
            raise GrammarCompileError(f"invalid {spec.kind} grammar: {_clean(payload)}")
        if backend == "llguidance":
            # Rebuilt here from the checked text (milliseconds for most grammars; the compiler
            # process bounded the time); counted by the text's size.
            text, paths, narrowed = payload
            return _llguidance_compile(*self.llg, spec, grammar=text, checked_paths=paths,
                                       narrowed=narrowed), len(text)
        compiled = self.xgr.CompiledGrammar.deserialize_json(payload, self.info)
        size = len(payload)
        del payload
        _trim_heap()
        return compiled, size

    # ------------------------------------------------------------------ compile + cache
    def compile(self, spec: GrammarSpec):
        """Compile (or fetch from the cache) ``spec``.

        Raises:
            GrammarCompileError: malformed input; keywords neither backend enforces (which and
                where, with llguidance's message); the backend refused it (its message is
                included); or compilation passed ``timeout_s``, died or ran out of memory.
        """
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit[0]
            spec = _check(spec)
            try:
                compiled, size = self._compile_backend(backend_for(spec), spec)
            except GrammarCompileError as e:
                fallback = fallback_for(spec)
                if fallback is None or (fallback == "llguidance" and isinstance(e, GrammarCompileLimitError)):
                    raise
                if fallback == "xgrammar":
                    compiled, size = self._compile_backend(fallback, spec)
                else:   # where llguidance refuses it too, xgrammar's verdict stands (its message)
                    try:
                        compiled, size = self._compile_backend(fallback, spec)
                    except GrammarCompileError:
                        raise e from None
            if getattr(compiled, "narrowed", ()):
                logger.info("schema served narrowed (valid instances it cannot produce): %s",
                            "; ".join(compiled.narrowed))
            if size <= self.cache_bytes:
                self._cache[key] = (compiled, size)
                self._cached_bytes += size
                evicted = False
                while self._cached_bytes > self.cache_bytes:
                    _, (_, old_size) = self._cache.popitem(last=False)
                    self._cached_bytes -= old_size
                    evicted = True
                if evicted:
                    _trim_heap()
            return compiled

    def _compile_backend(self, backend: str, spec: GrammarSpec):
        """(compiled grammar, its size for the cache) with ``backend``; raises as :meth:`compile`."""
        if self.isolate:
            return self._compile_isolated(backend, spec)
        compiled = self._compile_in_thread(backend, spec)
        return compiled, compiled.memory_size_bytes

    def _compile_in_thread(self, backend: str, spec: GrammarSpec):
        if backend == "llguidance":
            future = self._pool.submit(_llguidance_compile, *self.llg, spec)
        else:
            future = self._pool.submit(_compile_with, self.compiler, spec)
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise GrammarCompileLimitError(f"{spec.kind} grammar did not compile within {self.timeout_s:g} s") from None
        except GrammarCompileError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own types
            raise GrammarCompileError(f"invalid {spec.kind} grammar: {_clean(str(e))}") from None

    def matcher(self, spec: GrammarSpec) -> Matcher:
        """A fresh :class:`Matcher` for one request (xgrammar's or llguidance's); for a
        ``json_schema`` or ``tools`` (each call's JSON), with property names checked on the text
        (``replicas/name_checks.py``: one spelling per name, no name twice in an object)."""
        matcher = self.matcher_of(self.compile(spec))
        if spec.kind not in ("json_schema", "tools"):
            return matcher
        from replicas.name_checks import NameCheckedMatcher, NameTables
        if getattr(self, "_name_tables", None) is None:
            self._name_tables = NameTables(self._token_bytes(self.llg[0])[0])
        return NameCheckedMatcher(matcher, self._name_tables, list(self.info.stop_token_ids),
                                  tool_calls=spec.kind == "tools")

    def matcher_of(self, compiled) -> Matcher:
        """A fresh :class:`Matcher` for a grammar :meth:`compile` returned."""
        if isinstance(compiled, LLGuidanceGrammar):
            if compiled.checked_paths:
                from replicas.decode_checks import CheckedMatcher
                return CheckedMatcher(LLGuidanceMatcher(compiled), compiled.checked_paths,
                                            *self._token_bytes(compiled.tokenizer), compiled.tokenizer.eos_tokens)
            return LLGuidanceMatcher(compiled)
        return XGrammarMatcher(compiled)

    def _token_bytes(self, tok) -> tuple:
        """(each token's bytes, ids of the tokens holding a quote, ids with a ``,`` ``]`` ``}``
        ``[`` or ``{`` after a quote) for llguidance tokenizer ``tok``: built once."""
        if getattr(self, "_bytes_of", None) is None:
            data = [tok.decode_bytes([t]) for t in range(tok.vocab_size)]
            quotes = [t for t, b in enumerate(data) if b'"' in b]
            self._bytes_of = (data, torch.tensor(quotes, dtype=torch.long),
                              torch.tensor([t for t in quotes if any(c in b',]}[{' for c in data[t][data[t].index(b'"'):])],
                                           dtype=torch.long))
        return self._bytes_of

    def backend_of(self, spec: GrammarSpec) -> str:
        """Which backend serves ``spec`` ("xgrammar" or "llguidance"; compiles it where a fallback
        may apply, :func:`fallback_for`); raises as :meth:`compile`."""
        spec = _check(spec)
        if fallback_for(spec) is None:
            return backend_for(spec)
        return "llguidance" if isinstance(self.compile(spec), LLGuidanceGrammar) else "xgrammar"

    def apply_bitmask(self, logits: torch.Tensor, matchers: list) -> None:
        """Mask, in place, the tokens each row's matcher forbids (rows without a matcher untouched).

        One int32 bitmask ``[B, ceil(vocab / 32)]`` (bit ``t % 32`` of word ``t // 32`` set = token
        ``t`` allowed; the layout both backends write) is reused every step: xgrammar's rows are
        filled by its batch matcher, llguidance's by its executor, in the same buffer, then applied
        in one call. A llguidance matcher in its error state (a parser limit hit mid-output)
        allows only the stop tokens, so that the output ends.

        Args:
            logits: ``[B, vocab]`` float32, on any device.
            matchers: ``B`` entries, each a :class:`Matcher` or None.
        """
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        n = len(matchers)
        if self._bitmask is None or self._bitmask.shape[0] < n:   # one buffer, reused every step
            self._bitmask = self.xgr.allocate_token_bitmask(max(n, 8), self.vocab_size)
            self._batch = self.xgr.BatchGrammarMatcher()
        bitmask = self._bitmask[:n]
        xgr_rows = [i for i in rows if matchers[i].backend == "xgrammar"]
        llg_rows = [i for i in rows if matchers[i].backend == "llguidance"]
        if xgr_rows:   # xgrammar's batch API: its rows filled in one call (on its thread pool)
            self._batch.batch_fill_next_token_bitmask([matchers[i].native for i in xgr_rows], bitmask, indices=xgr_rows)
            for i in xgr_rows:
                if hasattr(matchers[i], "restrict"):   # property names checked on the text
                    matchers[i].restrict(bitmask[i])
        if llg_rows:
            import llguidance
            import llguidance.torch
            if self._executor is None:
                self._executor = llguidance.LLExecutor(num_threads=self.max_threads)
            llguidance.torch.fill_next_token_bitmask_par(self._executor, [(matchers[i].native, i) for i in llg_rows],
                                                         bitmask)
            for i in llg_rows:
                matchers[i].masked = True
                if hasattr(matchers[i], "restrict"):   # unique arrays, property names checked on the text
                    matchers[i].restrict(bitmask[i])
                if matchers[i].native.is_error():
                    bitmask[i].zero_()
                    for t in self.info.stop_token_ids:
                        bit = 1 << (t % 32)
                        bitmask[i, t // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit   # as int32
        index = rows if len(rows) < n else None
        self.xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=index)
