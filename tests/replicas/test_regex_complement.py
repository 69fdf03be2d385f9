"""The complement of a JSON Schema pattern (replicas/regex_complement.py) against Python's ``re``:
for patterns seen in JSONSchemaBench and strings hypothesis draws over their characters, a string
is in the complement exactly when the pattern, searched, matches it in neither the Unicode nor the
ASCII reading (the alphabet holds no character where ECMA-262's reading differs from both)."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replicas.regex_complement import MAX_CHARS, Unsupported, complement

PATTERNS = [
    r"^[0-9A-F]{8}-([0-9A-F]{4}-){3}[0-9A-F]{12}$",
    r"compound",
    r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$",
    r"^\d+([KMGT]i?B|B)$",
    r",,|^,|,$",
    r"(\+)\w+",
    r"^\{[\{%](.|[\r\n])*[\}%]\}$",
    r"^(?:[^a-df-zA-DF-Z\s]+(?:[umUM][sS]|[dhmsDHMS])\s?)+$",
    r"^[^/+#]+/[^/+#]+$",
    r"(?s:a.)|^x$",
]
ALPHABET = "aAbBcdeFimMsux01234589-_.,:/+#%{}\n\r\t \u0663\u00e9"


def _python(regex: str) -> str:
    """The complement's Rust-syntax escapes (``\\x{...}``) as Python's."""
    return re.sub(r"\\x\{([0-9a-f]+)\}", lambda m: "\\U%08x" % int(m.group(1), 16), regex)


@pytest.mark.parametrize("pattern", PATTERNS)
@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=24))
def test_complement_is_exactly_what_no_reading_matches(pattern, text):
    comp = complement(pattern)
    assert comp is not None and len(comp) <= MAX_CHARS
    inside = re.fullmatch(_python(comp), text) is not None
    matched = re.search(pattern, text) is not None or re.search(pattern, text, re.ASCII) is not None
    assert inside != matched, (pattern, text, comp[:200])


def test_strings_the_pattern_builds_are_outside():
    """Strings that match by construction (not drawn at random, which rarely hits a UUID)."""
    comp = re.compile(_python(complement(PATTERNS[0])))
    for s in ["0123ABCD-0000-1111-2222-333344445555", "0123ABCD-0000-1111-2222-333344445555\n"]:
        assert comp.fullmatch(s) is None
    assert comp.fullmatch("0123ABCD-0000-1111-2222-33334444555") is not None


def test_a_pattern_matching_everything_has_no_complement():
    assert complement("") is None and complement("x*") is None and complement("(?s:.)*") is None


@pytest.mark.parametrize("pattern", ["(?=a)b", "a(?!b)", "(a)\\1", "\\bx", "a^b", "a$b", "(?i)a", "(?m)^a$",
                                     "^[a-z]{0,61}\\.[a-z]{0,61}$", "(?>a)", "a*+"])
def test_unsupported_constructs_and_bounds_raise(pattern):
    with pytest.raises(Unsupported):
        complement(pattern)
