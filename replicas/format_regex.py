"""``format: regex`` as a pattern: a regular subset of the regular expressions that compile.

Which strings are regular expressions is not a regular language (groups nest without bound), so no
grammar can accept exactly those; llguidance refuses the format. ``jsonschema``'s format checker
calls a string valid where Python's ``re.compile`` takes it. :data:`REGEX_PATTERN` accepts a regular
subset of those, so that every string the grammar lets through compiles (sound), while it takes
most expressions written in practice (90 % of the 7,082 ``pattern`` s in JSONSchemaBench; the
rest are refused as instances: named groups, back-references, look-behind, groups nested past
:data:`MAX_DEPTH`, ``{`` as a literal, ...):

- literals (any character but ``\\ ^ $ . | ? * + ( ) [ ] { }``), ``.``, ``^``, ``$``;
- escapes of a non-alphanumeric character and the classes / controls ``\\d \\D \\w \\W \\s \\S
  \\n \\r \\t \\f \\v``; the assertions ``\\b \\B \\A \\Z``, never quantified ("nothing to
  repeat");
- classes ``[...]`` / ``[^...]`` of literals, those escapes (and ``\\b``, a backspace there) and
  ranges whose ends are both digits, both lowercase or both uppercase letters in order (a reversed
  range does not compile), with ``-`` first or last;
- one quantifier per atom (``* + ? {n} {n,} {,m} {0,m}``, three digits at most; ``{n,m}`` only
  from 0, so never reversed), optionally lazy;
- groups ``( )``, ``(?: )``, ``(?= )``, ``(?! )`` nested :data:`MAX_DEPTH` deep, alternatives
  with ``|`` (empty ones included);
- leading global flags ``(?i)``, ``(?m)``, ``(?s)`` (not ``x``: it makes whitespace vanish, and a
  quantifier after it can repeat nothing).

``tests/replicas/test_format_regex.py`` checks with hypothesis that strings drawn from the pattern
compile.
"""

from __future__ import annotations

MAX_DEPTH = 3   # nested groups

_LITERAL = r"[^\\^$.|?*+()\[\]{}]"
_ESCAPE = r"\\([^0-9A-Za-z]|[dDwWsSnrtfv])"
_ASSERTION = r"\\[bBAZ]"
_RANGES = "|".join(f"{c}-[{c}-{family[-1]}]" for family in ("0123456789", "abcdefghijklmnopqrstuvwxyz",
                                                             "ABCDEFGHIJKLMNOPQRSTUVWXYZ") for c in family)
_CLASS_ITEM = r"([^\\\]\[\-]|\\([^0-9A-Za-z]|[dDwWsSnrtfvb])|" + _RANGES + ")"
_CLASS = r"\[\^?-?" + _CLASS_ITEM + r"+-?\]"
_QUANTIFIER = r"(([*+?]|\{[0-9]{1,3},?\}|\{0?,[0-9]{1,3}\})\??)"


def _alternatives(depth: int) -> str:
    atoms = [_LITERAL, _ESCAPE, r"\.", _CLASS]
    if depth > 0:
        atoms.append(r"\((\?[:=!])?" + _alternatives(depth - 1) + r"\)")
    piece = f"(({'|'.join(atoms)}){_QUANTIFIER}?|{_ASSERTION}|\\^|\\$)"
    return f"({piece}|\\|)*"


REGEX_PATTERN = r"^(\(\?[ims]{1,3}\))?" + _alternatives(MAX_DEPTH) + "$"
