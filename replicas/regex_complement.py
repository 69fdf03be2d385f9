"""The complement of a JSON Schema ``pattern``, as a regex llguidance compiles: ``not {pattern:
P}`` written as ``{pattern: C}`` (``replicas/schema_oneof.py`` negates ``oneOf`` members with it).

JSON Schema searches a pattern (unanchored; ECMA-262 syntax), and validators read it in their own
dialect: Python's ``re`` (``jsonschema``), where ``\\d`` / ``\\w`` / ``\\s`` are Unicode and ``$``
also matches before a final newline, or ECMA-262's ASCII classes. So ``P`` is first read as the
*widest* set of whole strings any of these readings searches a match in (each character class the
union of its readings, a negated class the complement of the narrowest; an unanchored end is
``.*``, a ``$`` end allows one ``\\n`` after it). Its complement is then computed exactly on finite
automata with ``greenery`` (``Pattern.everythingbut``: complement of the minimal DFA, converted back
by state elimination) and printed with explicit code point ranges only (no ``\\d`` or ``.``, which
llguidance's Rust dialect reads its own way). Every string the complement matches is therefore
matched by ``P`` in none of the readings (sound); a string ``P`` misses only in some reading (a
Unicode digit for ``\\d``) is outside it too (complete for every string the readings agree on).

Refused (:class:`Unsupported`): look-around, back-references, word boundaries, anchors other than at
the ends of a top-level alternative, inline flags other than ``(?s:...)``, possessive / atomic
groups, and past the bounds on the work: :data:`MAX_POSITIONS` positions, a DFA over
:data:`MAX_STATES` states, a printed regex over :data:`MAX_CHARS`.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
import re

MAX_POSITIONS = 100   # characters of the pattern with its bounded repeats written out
MAX_STATES = 200      # states of the pattern's minimal DFA
MAX_CHARS = 20_000    # characters of the printed complement

try:   # Python 3.11+: re._parser / re._constants (sre_parse before)
    from re import _constants as _c
    from re import _parser as _p
except ImportError:   # pragma: no cover
    import sre_constants as _c
    import sre_parse as _p

_ECMA_SPACE = [(9, 13), (32, 32), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
               (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF)]
_CATEGORY = {_c.CATEGORY_DIGIT: "\\d", _c.CATEGORY_NOT_DIGIT: "\\D", _c.CATEGORY_WORD: "\\w",
             _c.CATEGORY_NOT_WORD: "\\W", _c.CATEGORY_SPACE: "\\s", _c.CATEGORY_NOT_SPACE: "\\S"}
_TOP = 0x10FFFF


class Unsupported(ValueError):
    """``pattern`` has a construct this module does not complement (module doc)."""


def _merge(ranges) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _invert(ranges) -> list[tuple[int, int]]:
    out, lo = [], 0
    for a, b in _merge(ranges):
        if a > lo:
            out.append((lo, a - 1))
        lo = b + 1
    return out + ([(lo, _TOP)] if lo <= _TOP else [])


def _intersect(a, b) -> list[tuple[int, int]]:
    return _invert(_invert(a) + _invert(b))


@functools.lru_cache(maxsize=None)
def _category(cat) -> tuple[list, list]:
    """(widest, narrowest) code point ranges of a class escape over Python's Unicode and ASCII
    readings and ECMA-262's (whose ``\\s`` adds U+FEFF)."""
    from replicas.schema_oneof import _char_ranges
    readings = [_char_ranges(_CATEGORY[cat], 0), _char_ranges(_CATEGORY[cat], re.ASCII)]
    if cat in (_c.CATEGORY_SPACE, _c.CATEGORY_NOT_SPACE):
        readings.append(_ECMA_SPACE if cat == _c.CATEGORY_SPACE else _invert(_ECMA_SPACE))
    wide = _merge([r for x in readings for r in x])
    narrow = readings[0]
    for x in readings[1:]:
        narrow = _intersect(narrow, x)
    return wide, narrow


def _class(items, narrow: bool = False) -> list[tuple[int, int]]:
    """The widest (``narrow``: narrowest) code point ranges of a ``[...]`` class's parsed items
    over the readings :func:`_category` takes."""
    negate = bool(items) and items[0][0] is _c.NEGATE
    ranges = []
    for op, av in items[1:] if negate else items:
        if op is _c.LITERAL:
            ranges.append((av, av))
        elif op is _c.RANGE:
            ranges.append(av)
        elif op is _c.CATEGORY and av in _CATEGORY:
            ranges += _category(av)[1 if negate != narrow else 0]
        else:
            raise Unsupported(f"class item {op}")
    return _invert(ranges) if negate else _merge(ranges)


def _charclass(ranges):
    from greenery import Charclass
    return Charclass(tuple((chr(a), chr(b)) for a, b in ranges))


def _mult(sub, lo: int, hi: int | None):
    from greenery.bound import Bound
    from greenery.multiplier import Multiplier
    from greenery.rxelems import Mult, Pattern
    return Mult(sub if isinstance(sub, Pattern) else sub, Multiplier(Bound(lo), Bound(hi)))


def _pattern(concs):
    from greenery.rxelems import Pattern
    return Pattern(*concs)


def _conc(mults):
    from greenery.rxelems import Conc
    return Conc(*mults)


_BEGIN, _END = 0x10FFFE, 0x10FFFF   # marker symbols for anchors inside a pattern (without_inner_anchors)
_ANCHORS = {_c.AT_BEGINNING: _BEGIN, _c.AT_BEGINNING_STRING: _BEGIN, _c.AT_END: _END, _c.AT_END_STRING: _END}


def _seq(items, dotall: bool, markers: bool = False, narrow: bool = False):
    """A parsed sequence (no anchors inside) as a greenery Conc, each class in its widest
    reading; with ``narrow``, in its narrowest (what every dialect matches); with ``markers``
    (narrow too), each ``^`` / ``$`` a marker symbol and every class without the markers' code
    points."""
    top = _BEGIN - 1 if markers else _TOP
    narrow = narrow or markers

    def cls(ranges):
        return _charclass(_intersect(_merge(ranges), [(0, top)]) if markers else ranges)
    mults = []
    for op, av in items:
        if op is _c.LITERAL:
            mults.append(_mult(cls([(av, av)]), 1, 1))
        elif op is _c.NOT_LITERAL:
            mults.append(_mult(cls(_invert([(av, av)])), 1, 1))
        elif op is _c.ANY:   # Python's "." is all but \n, ECMA-262's also excludes \r, U+2028/9
            dot = _invert([(10, 10), (13, 13), (0x2028, 0x2029)] if narrow else [(10, 10)])
            mults.append(_mult(cls([(0, _TOP)] if dotall else dot), 1, 1))
        elif op is _c.IN:
            mults.append(_mult(cls(_class(av, narrow=narrow)), 1, 1))
        elif op in (_c.MAX_REPEAT, _c.MIN_REPEAT):
            lo, hi, sub = av
            mults.append(_mult(_pattern([_seq(list(sub), dotall, markers, narrow)]), lo, None if hi == _c.MAXREPEAT else hi))
        elif op is _c.SUBPATTERN:
            _, add, remove, sub = av
            if remove or add & ~(_c.SRE_FLAG_DOTALL | _c.SRE_FLAG_UNICODE):
                raise Unsupported("inline flags")
            mults.append(_mult(_pattern([_seq(list(sub), dotall or bool(add & _c.SRE_FLAG_DOTALL), markers, narrow)]), 1, 1))
        elif op is _c.BRANCH:
            mults.append(_mult(_pattern([_seq(list(alt), dotall, markers, narrow) for alt in av[1]]), 1, 1))
        elif markers and op is _c.AT and av in _ANCHORS:
            mults.append(_mult(_charclass([(_ANCHORS[av], _ANCHORS[av])]), 1, 1))
        else:   # AT (anchors, \b), ASSERT / ASSERT_NOT, GROUPREF, ATOMIC_GROUP, POSSESSIVE_REPEAT, ...
            raise Unsupported(str(op))
    return _conc(mults)


def _alternatives(items) -> list[list]:
    """The pattern's top-level alternatives (a group around the whole pattern unwrapped)."""
    items = list(items)
    while len(items) == 1 and items[0][0] is _c.SUBPATTERN and not items[0][1][1] and not items[0][1][2]:
        items = list(items[0][1][3])
    if len(items) == 1 and items[0][0] is _c.BRANCH:
        return [list(alt) for alt in items[0][1][1]]
    return [items]


def widest_language(pattern: str):
    """A greenery ``Pattern`` of every whole string in which ``pattern`` finds a match under any
    reading (module doc). Raises :class:`Unsupported`."""
    return _language(pattern, narrow=False)


def _language(pattern: str, narrow: bool):
    """:func:`widest_language`; with ``narrow``, the strings in which it finds a match under every
    reading (each class in its narrowest reading, ``$`` without Python's final newline)."""
    try:
        parsed = _p.parse(pattern)
    except re.error as e:
        raise Unsupported(f"not a regex: {e}") from None
    if parsed.state.flags & ~(_c.SRE_FLAG_UNICODE):
        raise Unsupported("global flags")
    anything = _mult(_charclass([(0, _TOP)]), 0, None)
    concs = []
    for alt in _alternatives(parsed.data if hasattr(parsed, "data") else parsed):
        start = bool(alt) and alt[0] == (_c.AT, _c.AT_BEGINNING) or bool(alt) and alt[0] == (_c.AT, _c.AT_BEGINNING_STRING)
        alt = alt[1:] if start else alt
        end = None
        if alt and alt[-1][0] is _c.AT and alt[-1][1] in (_c.AT_END, _c.AT_END_STRING):
            end, alt = alt[-1][1], alt[:-1]
        body = _seq(alt, False, narrow=narrow)
        mults = ([] if start else [anything]) + list(body.mults)
        if end is None:
            mults.append(anything)
        elif end is _c.AT_END and not narrow:   # Python's $ matches before a final newline too
            mults.append(_mult(_charclass([(10, 10)]), 0, 1))
        concs.append(_conc(mults))
    return _pattern(concs)


def _covers(ranges, lo: int, hi: int) -> bool:
    return any(a <= lo and hi <= b for a, b in _merge(ranges))


def _class_regex(ranges) -> str:
    r"""Code point ranges as one regex atom of explicit ranges.

    llguidance 1.9 matches a JSON string's pattern on its escaped text, and a position whose set
    holds every control character (U+0000-U+001F) takes any escape there, ``\"`` and ``\\``
    included (measured: ``^[\x{0}-\x{21}]$`` accepted the string ``"``, ``^[\x{1}-\x{21}]$`` did
    not). A set without one of them takes the escapes of the others and no other (measured on
    1.9.1: ``[\x{1}-\x{21}\x{23}-\x{5b}]`` took ``\t``, ``\n``, ``\u0001``, ``\u001f``, not
    ``\"`` or ``\\``; an alternation ``[\x{1}-...]|\x{0}`` is merged back into one set and took
    ``\"``). So where such a set leaves out ``"`` or ``\``, U+0000 is left out of it: sound, and
    only a string with U+0000 there is rejected (until stop 43 every control character was left
    out: a tab was rejected)."""
    ranges = [(a, min(b, _TOP)) for a, b in _merge(ranges) if a <= _TOP]
    if _covers(ranges, 0, 0x1F) and not (_covers(ranges, 0x22, 0x22) and _covers(ranges, 0x5C, 0x5C)):
        ranges = _intersect(ranges, [(0x01, _TOP)])
    if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
        return _char(ranges[0][0])
    return "[" + "".join(_char(a) if a == b else f"{_char(a)}-{_char(b)}" for a, b in ranges) + "]"


# Regexes under construction: (text, kind), kind "eps" (the empty string), "atom" (one class or
# group), "cat" (a concatenation) or "alt" (an alternation); None is the empty language.
_EPS = ("", "eps")


def _alt(a, b):
    if a is None or a == b:
        return b
    if b is None:
        return a
    if a == _EPS or b == _EPS:
        x = b if a == _EPS else a
        if x[1] == "atom" and x[0].endswith(("?", "*")):
            return x   # matches the empty string already
        return (x[0] + "?" if x[1] == "atom" else f"(?:{x[0]})?", "atom")
    return (a[0] + "|" + b[0], "alt")


def _cat(a, b):
    if a is None or b is None:
        return None
    if a == _EPS:
        return b
    if b == _EPS:
        return a
    wrap = lambda x: f"(?:{x[0]})" if x[1] == "alt" else x[0]   # noqa: E731
    return (wrap(a) + wrap(b), "cat")


def _star(a):
    if a is None or a == _EPS:
        return _EPS
    return (a[0] + "*" if a[1] == "atom" and not a[0].endswith(("?", "*")) else f"(?:{a[0]})*", "atom")


def _complement_dfa(fsm) -> tuple:
    """(initial, finals, edges) of the DFA accepting what greenery's ``fsm`` does not: missing
    transitions go to a new non-final sink, which then accepts as every non-final state does.
    ``edges``: state -> {target: code point ranges}."""
    sink = object()
    edges: dict = {sink: {sink: [(0, _TOP)]}}
    for i in fsm.states:
        out = edges.setdefault(i, {})
        covered = []
        for cls, j in fsm.map.get(i, {}).items():
            if rs := _ranges_of(cls):
                out.setdefault(j, []).extend(rs)
                covered += rs
        rest = _invert(covered)
        if rest:
            out.setdefault(sink, []).extend(rest)
    finals = {i for i in fsm.states if i not in fsm.finals} | {sink}
    return fsm.initial, finals, edges


def _dfa_regex(initial, finals, edges) -> str | None:
    """A regex of a DFA's language by state elimination (Brzozowski and McCluskey, 1963), each
    edge's characters merged into one class; None for the empty language."""
    live, grew = set(finals), True
    while grew:   # states from which a final state is reachable
        grew = False
        for i, out in edges.items():
            if i not in live and any(j in live for j in out):
                live.add(i)
                grew = True
    if initial not in live:
        return None
    start, final = object(), object()
    r = {(i, j): (_class_regex(rs), "atom") for i, out in edges.items() if i in live
         for j, rs in out.items() if j in live and rs}
    r[(start, initial)] = _EPS
    for f in finals & live:
        r[(f, final)] = _EPS
    nodes = set(live)
    while nodes:
        def degree(k):
            ins = sum(1 for (i, j) in r if j == k and i != k)
            outs = sum(1 for (i, j) in r if i == k and j != k)
            return ins * outs
        k = min(nodes, key=degree)
        nodes.discard(k)
        loop = _star(r.pop((k, k), None))
        ins = [(i, x) for (i, j), x in r.items() if j == k]
        outs = [(j, x) for (i, j), x in r.items() if i == k]
        for i, _ in ins:
            del r[(i, k)]
        for j, _ in outs:
            del r[(k, j)]
        for i, a in ins:
            for j, b in outs:
                r[(i, j)] = _alt(r.get((i, j)), _cat(_cat(a, loop), b))
        if sum(len(x[0]) for x in r.values()) > MAX_CHARS:
            raise Unsupported("the complement's regex grows past MAX_CHARS")
    out = r.get((start, final))
    return None if out is None else out[0]


def _char(c: int) -> str:
    ch = chr(c)
    if ch.isascii() and ch.isalnum():
        return ch
    return "\\x{%x}" % c


def _positions(node) -> int:
    """Character positions of a greenery regex with its bounded repeats written out: what
    building its automaton costs (greenery's construction slows down past a few hundred)."""
    from greenery import Charclass
    from greenery.rxelems import Conc, Mult, Pattern
    if isinstance(node, Charclass):
        return 1
    if isinstance(node, Pattern):
        return sum(_positions(c) for c in node.concs)
    if isinstance(node, Conc):
        return sum(_positions(m) for m in node.mults)
    lo, hi = node.multiplier.min.v, node.multiplier.max.v
    return _positions(node.multiplicand) * max(1, hi if hi is not None else lo + 1)


@functools.lru_cache(maxsize=256)
def complement(pattern: str) -> str | None:
    """An anchored regex (``^...$``) matching exactly the strings outside :func:`widest_language`
    of ``pattern`` (None: there is no such string). Raises :class:`Unsupported`."""
    language = widest_language(pattern)
    if _positions(language) > MAX_POSITIONS:
        raise Unsupported(f"{_positions(language)} positions with the bounded repeats written out")
    fsm = language.to_fsm().reduce()
    if len(fsm.states) > MAX_STATES:
        raise Unsupported(f"{len(fsm.states)} DFA states")
    body = _dfa_regex(*_complement_dfa(fsm))
    if body is None:
        return None
    out = f"^(?:{body})$"
    if len(out) > MAX_CHARS:
        raise Unsupported(f"a complement of {len(out)} characters")
    return out


@functools.lru_cache(maxsize=1024)
def _language_fsm(pattern: str):
    language = widest_language(pattern)
    if _positions(language) > MAX_POSITIONS:
        raise Unsupported(f"{_positions(language)} positions with the bounded repeats written out")
    fsm = language.to_fsm().reduce()
    if len(fsm.states) > MAX_STATES:
        raise Unsupported(f"{len(fsm.states)} DFA states")
    return fsm


def length_bounds(pattern: str) -> tuple[int, int | None]:
    """``(lo, hi)``: the lengths, in characters, of the whole strings ``pattern`` matches in any
    reading (``hi`` None: unbounded, as for a pattern not anchored at both ends; Python's ``$``
    allows one final newline more). ``(0, None)`` where the pattern cannot be read."""
    try:
        parsed = _p.parse(pattern)
    except re.error:
        return 0, None
    if parsed.state.flags & ~(_c.SRE_FLAG_UNICODE):
        return 0, None
    lo, hi = None, 0
    begin = ((_c.AT, _c.AT_BEGINNING), (_c.AT, _c.AT_BEGINNING_STRING))
    for alt in _alternatives(parsed.data if hasattr(parsed, "data") else parsed):
        a, b = _p.SubPattern(parsed.state, list(alt)).getwidth()
        lo = a if lo is None else min(lo, a)
        ends = alt[-1] if alt else None
        if hi is None or not alt or alt[0] not in begin or ends[0] is not _c.AT or ends[1] not in (
                _c.AT_END, _c.AT_END_STRING) or b >= 1 << 31:
            hi = None
        else:
            hi = max(hi, b + (ends[1] is _c.AT_END))
    return lo or 0, hi


def _alphabet(items) -> list[tuple[int, int]]:
    """The code points a parsed pattern's matched text may hold (widest reading; a superset)."""
    out = []
    for op, av in items:
        if op is _c.LITERAL:
            out.append((av, av))
        elif op in (_c.NOT_LITERAL, _c.ANY):
            return [(0, _TOP)]
        elif op is _c.IN:
            out += _class(av)
        elif op in (_c.MAX_REPEAT, _c.MIN_REPEAT):
            out += _alphabet(av[2])
        elif op is _c.SUBPATTERN:
            out += _alphabet(av[3])
        elif op is _c.BRANCH:
            out += [r for alt in av[1] for r in _alphabet(alt)]
        elif op is not _c.AT:
            raise Unsupported(str(op))
    return _merge(out)


@functools.lru_cache(maxsize=1024)
def _closure_fsm(pattern: str):
    """A small DFA of a superset of :func:`widest_language`: any string over the characters
    the pattern may use, with every character allowed where it is not anchored at both ends."""
    try:
        parsed = _p.parse(pattern)
    except re.error as e:
        raise Unsupported(f"not a regex: {e}") from None
    if parsed.state.flags & ~(_c.SRE_FLAG_UNICODE):
        raise Unsupported("global flags")
    chars = _alphabet(parsed.data if hasattr(parsed, "data") else parsed) + [(10, 10)]
    if length_bounds(pattern)[1] is None:
        chars = [(0, _TOP)]   # (a search: whatever surrounds the match)
    return _mult(_charclass(_merge(chars)), 0, None).to_fsm()


def _anchored(pattern: str) -> bool:
    """Whether every top-level alternative of ``pattern`` starts with ``^`` and ends with ``$``."""
    try:
        parsed = _p.parse(pattern)
    except re.error:
        return False
    alts = _alternatives(parsed.data if hasattr(parsed, "data") else parsed)
    return all(len(a) >= 2 and a[0][0] is _c.AT and a[0][1] in (_c.AT_BEGINNING, _c.AT_BEGINNING_STRING)
               and a[-1][0] is _c.AT and a[-1][1] in (_c.AT_END, _c.AT_END_STRING) for a in alts)


def _cheap(pattern: str) -> bool:
    """Whether greenery builds ``pattern``'s automaton quickly: anchored at both ends, or searched
    without a counted repeat (``.*(doi:)?10.[0-9]{4,9}.*`` took 27 s, ``.*[0-9]{0,8}.*`` 1 s)."""
    if _anchored(pattern):
        return True
    def counted(items) -> bool:
        for op, av in items:
            if op in (_c.MAX_REPEAT, _c.MIN_REPEAT):
                if av[1] is not _c.MAXREPEAT and av[1] > 1 or counted(av[2]):
                    return True
            elif op is _c.SUBPATTERN and counted(av[3]):
                return True
            elif op is _c.BRANCH and any(counted(a) for a in av[1]):
                return True
        return False
    try:
        parsed = _p.parse(pattern)
    except re.error:
        return False
    return not counted(parsed.data if hasattr(parsed, "data") else parsed)


def patterns_disjoint(a: str, b: str) -> bool:
    """Whether no string is matched by both patterns, in any reading (proved on automata: their
    :func:`widest_language` s do not intersect; where one is past the bounds, the strings over
    its characters stand for it). False where that is not so or not proved."""
    def fsm(p):
        if not _cheap(p):
            return _closure_fsm(p)
        try:
            return _language_fsm(p)
        except Unsupported:
            return _closure_fsm(p)
    try:
        return fsm(a).isdisjoint(fsm(b))
    except Unsupported:
        return False


def pattern_misses(pattern: str, value: str) -> bool:
    """Whether ``pattern`` finds no match in ``value`` in any reading. False where unknown."""
    if not _cheap(pattern):
        return False   # (see patterns_disjoint)
    try:
        return not _language_fsm(pattern).accepts(value)
    except Unsupported:
        return False


def _class_text_ranges(text: str, negated: bool) -> list[tuple[int, int]] | None:
    """The code points a class ``[...]`` / ``[^...]`` (its source ``text``, as users write it:
    ``[\\x00-\\x1f]``, ``[^"\\w]``) matches in *every* reading (:func:`_class`, narrowest), or
    None where Python's parser cannot read it or it is not a class of that kind."""
    try:
        parsed = list(_p.parse(text))
    except (re.error, RecursionError, OverflowError):
        return None
    if len(parsed) != 1:
        return None
    op, av = parsed[0]
    if op is _c.NOT_LITERAL and negated:
        return _invert([(av, av)])
    if op is not _c.IN or not av or (av[0][0] is _c.NEGATE) != negated:
        return None
    try:
        return _class(av, narrow=True) or None
    except Unsupported:
        return None


_EXPLICIT_ITEM = re.compile(r"\\x\{([0-9A-Fa-f]{1,6})\}|\\([^A-Za-z0-9])|([^\\\[\]\-])")


def _explicit_class_ranges(text: str) -> list[tuple[int, int]] | None:
    r"""The code points of a positive class written with explicit characters only (``\x{..}``,
    escaped punctuation, plain characters, ranges of those: what the complement's printer
    writes), or None for any other class."""
    body, pos, ranges = text[1:-1], 0, []

    def item(at):
        m = _EXPLICIT_ITEM.match(body, at)
        if not m:
            return None, at
        c = int(m.group(1), 16) if m.group(1) else ord(m.group(2) or m.group(3))
        return c, m.end()
    while pos < len(body):
        lo, pos = item(pos)
        if lo is None:
            return None
        hi = lo
        if pos < len(body) - 1 and body[pos] == "-":
            hi, pos = item(pos + 1)
            if hi is None or hi < lo:
                return None
        ranges.append((lo, hi))
    return _merge(ranges) or None


def explicit_negated_classes(pattern: str) -> str:
    """``pattern`` with each negated class that excludes ``"`` or ``\\`` written as the positive
    class of the code points it matches in every reading (explicit ranges), and each positive
    class of explicit ranges that holds every control character but not ``"`` or ``\\`` written
    without the control characters.

    llguidance 1.9 lets a set holding every control character take any escape
    (:func:`_class_regex`): ``^[^"]$`` accepted ``"\\""`` and ``^[^\\\\]$`` a backslash
    (measured). The explicit class leaves the control characters out there. A class this cannot read (``[]...]``,
    an escape Python's ``re`` does not parse) is left as written."""
    out, i, n = [], 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if c != "[":
            out.append(c)
            i += 1
            continue
        j = i + 1
        negated = j < n and pattern[j] == "^"
        j += negated
        if j < n and pattern[j] == "]":   # "[]" / "[^]" differ between dialects: left alone
            out.append(c)
            i += 1
            continue
        while j < n and pattern[j] != "]":
            j += 2 if pattern[j] == "\\" else 1
        if j >= n:   # no end: not a class llguidance would take either
            out.append(pattern[i:])
            break
        text = pattern[i:j + 1]
        ranges = (_explicit_class_ranges(text) if not negated else None) or _class_text_ranges(text, negated)
        if ranges and not all(any(a <= q <= b for a, b in ranges) for q in (0x22, 0x5C)) and (
                negated or _covers(ranges, 0, 0x1F)):
            out.append(_class_regex(ranges))
        else:
            out.append(text)
        i = j + 1
    return "".join(out)


def _somewhere(items, hit) -> bool:
    """Whether ``hit(op, av)`` holds for an item of a parsed pattern at any depth (inside
    repeats, groups and alternatives)."""
    for op, av in items:
        if hit(op, av):
            return True
        if op in (_c.MAX_REPEAT, _c.MIN_REPEAT, _c.POSSESSIVE_REPEAT) and _somewhere(av[2], hit):
            return True
        if op in (_c.SUBPATTERN, _c.ATOMIC_GROUP) and _somewhere(av[-1], hit):
            return True
        if op is _c.BRANCH and any(_somewhere(a, hit) for a in av[1]):
            return True
    return False


def _ranges_of(cls) -> list[tuple[int, int]]:
    """The code point ranges of a greenery Charclass (a negated one inverted), capped at U+10FFFF."""
    return _invert(cls.ord_ranges) if cls.negated else [(a, min(b, _TOP)) for a, b in cls.ord_ranges if a <= _TOP]


def _anchored_regex(initial, finals, edges) -> str:
    """``^(?:...)$`` of a DFA (:func:`_dfa_regex`). Raises :class:`Unsupported` where its language
    is empty or the regex passes :data:`MAX_CHARS`."""
    body = _dfa_regex(initial, finals, edges)
    if body is None:
        raise Unsupported("no string matches")
    out = f"^(?:{body})$"
    if len(out) > MAX_CHARS:
        raise Unsupported(f"a regex of {len(out)} characters")
    return out


def extendable(pattern: str) -> bool:
    """Whether every string ``pattern`` finds a match in can be continued into a longer one it
    also finds a match in, in every reading: no end anchor, boundary or look-around anywhere
    (appending keeps the match), or each top-level alternative ends ``X$`` where ``X`` ends with
    an unbounded repeat of something non-empty (``^[a-z][a-z0-9]*$``: append one more).
    False where unsure (a pattern Python's ``re`` does not parse, global flags). The explicit
    ``\\x{HHHH}`` code points this module prints for llguidance are read as Python's ``\\U``."""
    pattern = re.sub(r"(?<!\\)\\x\{([0-9a-fA-F]{1,6})\}", lambda m: "\\U%08x" % int(m.group(1), 16), pattern)
    try:
        parsed = _p.parse(pattern)
    except re.error:
        return False
    if parsed.state.flags & ~(_c.SRE_FLAG_UNICODE):
        return False
    ends = (_c.AT_END, _c.AT_END_STRING, _c.AT_BOUNDARY, _c.AT_NON_BOUNDARY)

    def pinned(items) -> bool:   # an end anchor, boundary or assertion somewhere
        return _somewhere(items, lambda op, av: op is _c.AT and av in ends or op in (
            _c.ASSERT, _c.ASSERT_NOT, _c.GROUPREF, _c.GROUPREF_EXISTS))

    def open_end(items) -> bool:   # ends with an unbounded repeat of something non-empty
        if not items:
            return False
        op, av = items[-1]
        if op in (_c.MAX_REPEAT, _c.MIN_REPEAT):
            return av[1] is _c.MAXREPEAT and av[2].getwidth()[1] > 0
        if op is _c.SUBPATTERN:
            return open_end(list(av[3]))
        if op is _c.BRANCH:
            return all(open_end(list(a)) for a in av[1])
        return False

    data = parsed.data if hasattr(parsed, "data") else parsed
    if not pinned(data):
        return True
    for alt in _alternatives(data):
        if alt and alt[-1][0] is _c.AT and alt[-1][1] in (_c.AT_END, _c.AT_END_STRING):
            if pinned(alt[:-1]) or not open_end(alt[:-1]):
                return False
        elif pinned(alt):
            return False
    return True


def inner_anchors(pattern: str) -> bool:
    """Whether ``pattern`` has a ``^`` or ``$`` other than at the start / end of a top-level
    alternative (``(a|$)``, ``^$x``), which llguidance refuses ("lookarounds not supported")."""
    try:
        parsed = _p.parse(pattern)
    except re.error:
        return False
    for alt in _alternatives(parsed.data if hasattr(parsed, "data") else parsed):
        start = 1 if alt and alt[0][0] is _c.AT and alt[0][1] in (_c.AT_BEGINNING, _c.AT_BEGINNING_STRING) else 0
        end = len(alt) - 1 if len(alt) > start and alt[-1][0] is _c.AT and alt[-1][1] in (_c.AT_END, _c.AT_END_STRING) else len(alt)
        if _somewhere(alt[start:end], lambda op, av: op is _c.AT and av in _ANCHORS):
            return True
    return False


@functools.lru_cache(maxsize=256)
def without_inner_anchors(pattern: str) -> str:
    """An anchored regex (``^...$``, no other anchor) matching exactly the strings in which
    ``pattern``, whose ``^`` / ``$`` may sit anywhere (:func:`inner_anchors`), finds a match as
    ECMA-262 reads anchors: ``^`` at the start only, ``$`` at the very end only (Python's ``$``
    also matches before a final newline: such a string is not taken; sound). Classes and ``.``
    take their narrowest reading (what Python's Unicode and ASCII readings and ECMA-262's all
    match), so every string taken is one each dialect matches.

    On automata: each anchor becomes a marker symbol (``B`` for ``^``, ``E`` for ``$``), the
    pattern is searched (``.*P.*`` over real characters) and compiled to a DFA; a string ``w``
    matches where ``B^j w E^k`` is accepted for some ``j``, ``k`` (markers consumed only at the
    very start and end), which a subset construction over the DFA's states writes as a DFA of
    real characters, printed back as :func:`complement` does. Raises :class:`Unsupported` (past
    the bounds, or where no string matches)."""
    try:
        parsed = _p.parse(pattern)
    except re.error as e:
        raise Unsupported(f"not a regex: {e}") from None
    if parsed.state.flags & ~(_c.SRE_FLAG_UNICODE):
        raise Unsupported("global flags")
    anything = _mult(_charclass([(0, _BEGIN - 1)]), 0, None)
    body = _seq(list(parsed.data if hasattr(parsed, "data") else parsed), False, markers=True)
    language = _pattern([_conc([anything] + list(body.mults) + [anything])])
    if _positions(language) > MAX_POSITIONS:
        raise Unsupported(f"{_positions(language)} positions with the bounded repeats written out")
    fsm = language.to_fsm().reduce()
    if len(fsm.states) > MAX_STATES:
        raise Unsupported(f"{len(fsm.states)} DFA states")
    real: dict = {}
    marker: dict = {}
    for i in fsm.states:
        for cls, j in fsm.map.get(i, {}).items():
            for a, b in _ranges_of(cls):
                for m in (_BEGIN, _END):
                    if a <= m <= b:
                        marker[(i, m)] = j
                if a < _BEGIN:
                    real.setdefault(i, []).append((a, min(b, _BEGIN - 1), j))
    start = {fsm.initial}
    while True:   # markers for "^" read at the start
        more = start | {marker[(i, _BEGIN)] for i in start if (i, _BEGIN) in marker}
        if more == start:
            break
        start = more
    ends = set(fsm.finals)
    while True:   # states from which markers for "$" reach a final state
        more = ends | {i for i in fsm.states if marker.get((i, _END)) in ends}
        if more == ends:
            break
        ends = more
    initial = frozenset(start)
    edges: dict = {}
    todo = [initial]
    while todo:
        subset = todo.pop()
        if subset in edges:
            continue
        if len(edges) > MAX_STATES:
            raise Unsupported("more than MAX_STATES subsets")
        spans = [e for i in subset for e in real.get(i, [])]
        cuts = sorted({a for a, _, _ in spans} | {b + 1 for _, b, _ in spans})
        out: dict = {}
        for lo, hi in zip(cuts, cuts[1:]):
            target = frozenset(j for a, b, j in spans if a <= lo and hi - 1 <= b)
            if target:
                out.setdefault(target, []).append((lo, hi - 1))
                todo.append(target)
        edges[subset] = {t: _merge(rs) for t, rs in out.items()}
    return _anchored_regex(initial, {subset for subset in edges if subset & ends}, edges)


def _fsm_regex(fsm) -> str:
    """``^(?:...)$`` of a greenery FSM's language (:func:`_dfa_regex`). Raises :class:`Unsupported`
    past the bounds or where the language is empty."""
    fsm = fsm.reduce()
    if len(fsm.states) > MAX_STATES:
        raise Unsupported(f"{len(fsm.states)} DFA states")
    edges: dict = {}
    for i in fsm.states:
        out = edges.setdefault(i, {})
        for cls, j in fsm.map.get(i, {}).items():
            if rs := _ranges_of(cls):
                out.setdefault(j, []).extend(rs)
    return _anchored_regex(fsm.initial, set(fsm.finals), {i: {j: _merge(rs) for j, rs in o.items()} for i, o in edges.items()})


MAX_REGIONS_PATTERNS = 6   # patterns split into disjoint regions (2^n - 1 regions at most)
REGIONS_SECONDS = 2.0      # work on them (a compile's bound is 10 s)
MAX_REGION_STATES = 1_000  # the product of the patterns' DFA states
MAX_REGION_CHARS = 1_000   # a region's regex (llguidance cannot tell longer ones disjoint, or takes seconds)


def disjoint_regions(patterns: tuple[str, ...]) -> tuple[list[tuple[str, tuple[int, ...]]], str | None]:
    """Property-name patterns that may overlap, split into disjoint regions: ``([(regex, T),
    ...], apart)``, for each non-empty set ``T`` of their indices an anchored regex of exactly the
    names every pattern of ``T`` finds a match in and no other does, in every reading (empty
    regions left out), and ``apart``: an anchored regex of the names some pattern matches in one
    reading and not another (``"MD5\\n"`` for ``^MD5$`` in Python only; a Unicode letter for
    ``\\w``), or None where there is none. The regions and ``apart`` are pairwise disjoint and
    cover every name a pattern matches in some reading. Raises :class:`Unsupported` past the
    bounds (:data:`MAX_REGIONS_PATTERNS` patterns, each as :func:`complement`,
    :data:`REGIONS_SECONDS` of work, :data:`MAX_REGION_STATES`, a region's regex past
    :data:`MAX_REGION_CHARS`)."""
    if len(patterns) > MAX_REGIONS_PATTERNS:
        raise Unsupported(f"{len(patterns)} patterns")
    wide, narrow = [_language_fsm(p) for p in patterns], [_narrow_fsm(p) for p in patterns]
    if math.prod(len(w.states) for w in wide) > MAX_REGION_STATES:   # (greenery takes seconds past it)
        raise Unsupported("regions of too many DFA states")
    apart = None
    for w, n in zip(wide, narrow):
        d = w & n.everythingbut()
        apart = d if apart is None else apart | d
    out, deadline = [], time.monotonic() + REGIONS_SECONDS
    for size in range(len(patterns), 0, -1):
        for group in itertools.combinations(range(len(patterns)), size):
            if time.monotonic() > deadline:   # (greenery's products of unanchored patterns: seconds each)
                raise Unsupported(f"regions past {REGIONS_SECONDS} s")
            region = apart.everythingbut()
            for i in range(len(patterns)):
                region = region & (narrow[i] if i in group else wide[i].everythingbut())
            if not region.reduce().empty():
                out.append((_fsm_regex(region), group))
    out.append((None if apart.reduce().empty() else _fsm_regex(apart), ()))
    if any(rx is not None and len(rx) > MAX_REGION_CHARS for rx, _ in out):
        raise Unsupported("a region's regex past MAX_REGION_CHARS")
    return out[:-1], out[-1][0]


@functools.lru_cache(maxsize=1024)
def _narrow_fsm(pattern: str):
    """The minimal DFA of the strings ``pattern`` finds a match in under every reading (as
    :func:`_language_fsm` for the widest). Raises :class:`Unsupported`."""
    language = _language(pattern, narrow=True)
    if _positions(language) > MAX_POSITIONS:
        raise Unsupported(f"{_positions(language)} positions with the bounded repeats written out")
    return language.to_fsm().reduce()


def matches_everything(pattern: str) -> bool:
    """Whether ``pattern`` finds a match in every string, in every reading (``.*``, ``""``,
    ``^``); False where it cannot be read here."""
    try:
        fsm = _narrow_fsm(pattern)
    except Unsupported:
        return False
    if fsm.initial not in fsm.finals:   # (and a loop on it over every code point: every string stays there)
        return False
    ranges = [r for cls, j in fsm.map.get(fsm.initial, {}).items() if j == fsm.initial for r in _ranges_of(cls)]
    return _covers(ranges, 0, _TOP)


def alphabet(pattern: str) -> list[tuple[int, int]]:
    """The code point ranges the text ``pattern`` matches may hold (widest reading; a superset).
    Raises :class:`Unsupported`."""
    try:
        parsed = _p.parse(pattern)
    except re.error as e:
        raise Unsupported(f"not a regex: {e}") from None
    return _alphabet(parsed.data if hasattr(parsed, "data") else parsed)


def reads_alike(pattern: str) -> bool:
    """Whether ``pattern`` finds a match in the same strings in every reading (False where it
    cannot be read here)."""
    try:
        return _language_fsm(pattern).equivalent(_narrow_fsm(pattern))
    except Unsupported:
        return False


def search_in_every_reading(pattern: str, name: str) -> bool | None:
    """Whether ``pattern`` finds a match in ``name``; None where its readings disagree on it (or
    it cannot be read here)."""
    try:
        wide = _language_fsm(pattern).accepts(name)
        return wide if _narrow_fsm(pattern).accepts(name) == wide else None
    except Unsupported:
        return None


@functools.lru_cache(maxsize=1024)
def finite_names(pattern: str, limit: int) -> tuple[str, ...] | None:
    """Every string in which ``pattern`` finds a match under every reading (module doc), shortest
    first, where there are at most ``limit`` of them (``^line[1-3]$``: ``line1``, ``line2``,
    ``line3``); None where there are more (a search not anchored at both ends has infinitely many)
    or the pattern cannot be read here. A string only some reading matches (Python's
    ``"line1\\n"``) is not listed."""
    if length_bounds(pattern)[1] is None:
        return None   # (unbounded: not anchored at both ends, or a free repeat; its DFA can be slow to build)
    try:
        fsm = _narrow_fsm(pattern)
        count = fsm.cardinality()
    except (Unsupported, OverflowError):
        return None
    if count > limit:
        return None
    names = tuple(itertools.islice(fsm.strings([]), limit + 1))
    return names if len(names) == count else None


def lookaheads(pattern: str) -> bool:
    """Whether ``pattern`` has a look-ahead (``(?=...)`` / ``(?!...)``), which llguidance refuses."""
    try:
        parsed = _p.parse(pattern)
    except re.error:
        return False
    return _somewhere(parsed.data if hasattr(parsed, "data") else parsed,
                      lambda op, av: op in (_c.ASSERT, _c.ASSERT_NOT))


@functools.lru_cache(maxsize=256)
def without_lookaheads(pattern: str) -> str:
    """An anchored regex (``^...$``) with no look-around matching exactly the strings in which
    ``pattern`` finds a match, for the forms users write: look-aheads right after a top-level
    ``^`` (``^(?!org\\.bukkit\\.)[a-z.]+$``, ``^(?=.{1,255}$)...``), each the whole string's
    start (``X`` then anything, or ``X`` alone where it ends with ``$``), and a positive
    look-ahead ending a top-level alternative not anchored at its end (``a(?=\\.json)``: the
    same as ``a\\.json`` searched). Built on automata: the rest of the alternative intersected
    with each positive look-ahead's language and less each negative one's. Readings chosen so
    the result is sound in every dialect: what the string must match in its narrowest reading,
    what it must not match in its widest (with Python's ``$`` before a final newline); anchors
    as ECMA-262 reads them. Raises :class:`Unsupported` (a look-ahead elsewhere, look-behind,
    past the bounds, no string matches)."""
    try:
        parsed = _p.parse(pattern)
    except re.error as e:
        raise Unsupported(f"not a regex: {e}") from None
    if parsed.state.flags & ~(_c.SRE_FLAG_UNICODE):
        raise Unsupported("global flags")
    anything = _mult(_charclass([(0, _TOP)]), 0, None)
    begin = ((_c.AT, _c.AT_BEGINNING), (_c.AT, _c.AT_BEGINNING_STRING))
    total = None
    for alt in _alternatives(parsed.data if hasattr(parsed, "data") else parsed):
        alt = list(alt)
        start = bool(alt) and alt[0] in begin
        alt = alt[1:] if start else alt
        heads = []
        while alt and alt[0][0] in (_c.ASSERT, _c.ASSERT_NOT) and alt[0][1][0] == 1:
            heads.append(alt.pop(0))
        if heads and not start:
            raise Unsupported("a look-ahead in a search not anchored at its start")
        end = bool(alt) and alt[-1][0] is _c.AT and alt[-1][1] in (_c.AT_END, _c.AT_END_STRING)
        alt = alt[:-1] if end else alt
        tail = []
        if not end and alt and alt[-1][0] is _c.ASSERT and alt[-1][1][0] == 1:
            tail = list(alt.pop()[1][1])
        body = _seq(alt + tail, False, narrow=True)
        mults = ([] if start else [anything]) + list(body.mults) + ([] if end else [anything])
        language = _pattern([_conc(mults)])
        if _positions(language) > MAX_POSITIONS:
            raise Unsupported(f"{_positions(language)} positions with the bounded repeats written out")
        fsm = language.to_fsm()
        for op, (_, sub) in heads:
            sub = list(sub)
            closed = sub[-1][1] if sub and sub[-1][0] is _c.AT and sub[-1][1] in (_c.AT_END, _c.AT_END_STRING) else None
            sub = sub[:-1] if closed else sub
            x = _seq(sub, False, narrow=op is _c.ASSERT)
            if closed is None:
                after = [anything]
            elif op is _c.ASSERT or closed is _c.AT_END_STRING:
                after = []
            else:   # (widest: Python's $ also before a final newline)
                after = [_mult(_charclass([(10, 10)]), 0, 1)]
            ahead = _pattern([_conc(list(x.mults) + after)])
            if _positions(ahead) > MAX_POSITIONS:
                raise Unsupported("a look-ahead past the bounds")
            fsm = fsm.intersection(ahead.to_fsm()) if op is _c.ASSERT else fsm.difference(ahead.to_fsm())
        total = fsm if total is None else total.union(fsm)
    return _fsm_regex(total)

