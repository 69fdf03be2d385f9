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


PAIRS = [(r"^u?int(8|16)?(\[[0-9]*\])*$", r"^u?fixed(8x8|16x8)?$"), (r"^a", r"b$"), (r"^[a-c]+$", r"^\d+$"),
         (r"^x{2}$", r"^x{3}$"), (r"^\w+$", r"^[-.]+$"), (r"^ab", r"^a"),
         (r"^[0-9a-zA-Z_-]{1,255}$", r".*\{\{.+}}.*"), (r"^[a-z]{1,255}$", r"^.{3}$")]


@pytest.mark.parametrize("a,b", PAIRS)
@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=12))
def test_patterns_proved_disjoint_share_no_string(a, b, text):
    from replicas.regex_complement import patterns_disjoint
    if patterns_disjoint(a, b):
        assert not any(re.search(a, text, f) for f in (0, re.ASCII)) or not any(
            re.search(b, text, f) for f in (0, re.ASCII)), (a, b, text)


def test_disjointness_is_proved_where_it_holds_and_only_there():
    """(The last two pairs are past the DFA bound: the first pattern's characters stand for it.)"""
    from replicas.regex_complement import pattern_misses, patterns_disjoint
    assert [patterns_disjoint(a, b) for a, b in PAIRS] == [True, False, True, True, True, False, True, False]
    assert pattern_misses("^a$", "b") and not pattern_misses("^a$", "a\n") and not pattern_misses("(?=a)", "b")
    assert pattern_misses("a", "b") and not pattern_misses("[0-9]{2}", "x")   # (a counted search: not tried)


COUNTED = [r"^[0-9a-f]{4}$", r"^[a-c]{2,3}$", r"^x{2,}$", r"^\d{1}$", r"^.{0,2}$"]


@pytest.mark.parametrize("pattern", COUNTED)
@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=7))
def test_counted_class_complement_is_exactly_what_no_reading_matches(pattern, text):
    from replicas.schema_oneof import _counted_class_complement
    inside = any(re.fullmatch(_python(c), text) for c in _counted_class_complement(pattern))
    matched = any(re.search(pattern, text, f) for f in (0, re.ASCII))
    assert inside != matched, (pattern, text)


@pytest.mark.parametrize("pattern,expected", [
    ("^[a-z]+$", True), ("abc", True), ("^https?://", True), ("^(a+|b*)$", True), ("^x{2,}$", True),
    ("^(ab)*$", True), ("^v[0-9]+(\\.[0-9]+)*$", True),
    ("^[a-z]$", False), ("^(a+|b)$", False), ("^[0-9]{3}$", False), ("^a*$|^b$", False), ("^a(?=b)", False),
    ("(", False),
])
def test_extendable(pattern, expected):
    """Whether every string a pattern matches goes on into a longer one it matches (what lets a
    unique array of such strings refuse a repeat without a dead end)."""
    from replicas.regex_complement import extendable
    assert extendable(pattern) is expected


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_extendable_strings_go_on(data):
    """On strings drawn from each pattern :func:`extendable` accepts: something appended keeps a
    match (the grammar writes no final newline, which Python's ``$`` also allows)."""
    pattern = data.draw(st.sampled_from(["^[a-z]+$", "abc", "^https?://", "^(a+|b*)$", "^x{2,}$", "^(ab)*$",
                                         "^v[0-9]+(\\.[0-9]+)*$", "^[A-Z][a-zA-Z0-9_]*$"]))
    s = data.draw(st.from_regex(pattern, fullmatch=True).filter(lambda x: not x.endswith("\n")))
    assert any(re.search(pattern, s + e) for e in [*"abxzAZ09_", "ab", "/"]), (pattern, s)


INNER = [r"^(\/?((\.{2})|([a-z0-9\-]*))($|\/))*$", r"^$[a-z$_]*$", r"^a(b|$)", r"(^a|b)c", r"(a$|b)c?", r"x(^|y)z"]


def _python(regex: str) -> str:
    return re.sub(r"\\x\{([0-9a-fA-F]+)\}", lambda m: "\\U%08x" % int(m.group(1), 16), regex)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(INNER), st.text(alphabet="ab/.-xyz0c$_", max_size=8))
def test_inner_anchors_written_out_exactly(pattern, s):
    """Anchors inside a pattern (which llguidance refuses) written out on automata: the regex
    matches a string whole exactly where the pattern finds a match in it (no newline drawn: there
    Python's ``$`` also matches before a final one, which the rewrite does not take)."""
    from replicas.regex_complement import inner_anchors, without_inner_anchors
    assert inner_anchors(pattern)
    out = without_inner_anchors(pattern)
    assert (re.search(pattern, s) is not None) == (re.fullmatch(_python(out), s) is not None), (pattern, out, s)


def test_inner_anchors_detected_and_impossible_ones_refused():
    from replicas.regex_complement import inner_anchors, without_inner_anchors
    assert not any(map(inner_anchors, ["^[a-z]+$", "abc", "^(a|b)$"]))
    with pytest.raises(Unsupported):
        without_inner_anchors(r"\/^[0-9]{4}$\/")   # "/" before the start: no string matches


def test_inner_anchor_pattern_served(engine):
    """A path pattern from JSONSchemaStore with ``($|\\/)`` inside: served by llguidance after the
    rewrite, valid and invalid strings through the matcher."""
    from bench.grammar_soundness import Grammar
    schema = {"type": "object", "properties": {"p": {"type": "string", "pattern": INNER[0]}}, "required": ["p"]}
    g = Grammar(engine.grammar, engine.tokenizer, schema)
    assert g.backend == "llguidance"
    for ok in ("a/b", "../x", "", "a/", "/a-b/c"):
        assert g.guided({"p": ok}) is not None, ok
    for bad in ("A", "a b", "...", "a/./b"):
        assert g.guided({"p": bad}) is None, bad


AHEAD = [r"^(?!@@)[@a-zA-Z0-9_-]+$", r"^(?!interactive|name|style).+$", r"^(?=[^=]+$)(?![ \t]+$)(.|\n)+$",
         r"((?:[^\/]*\/)*)(?=\.(yaml|yml|json))", r"^(?![i|I][o|O][b|B])", r"^(?=.{1,5}$)[a-z.]+$",
         r"^(?!org\.bukkit\.)([a-zA-Z_$][a-zA-Z0-9_$]*\.)*[a-zA-Z_$][a-zA-Z0-9_$]*$"]


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(AHEAD), st.text(alphabet="@ab.=/\t yamljsonio_IOBgk", max_size=10))
def test_lookaheads_written_out_exactly(pattern, s):
    """Look-aheads after ``^`` (and one ending an unanchored pattern), which llguidance refuses,
    written out on automata: whole-string match exactly where the pattern finds a match."""
    from replicas.regex_complement import lookaheads, without_lookaheads
    assert lookaheads(pattern)
    out = without_lookaheads(pattern)
    assert (re.search(pattern, s) is not None) == (re.fullmatch(_python(out), s) is not None), (pattern, s)


@pytest.mark.parametrize("pattern", [r"^((?!mode).)*$", r"a(?!b)c", r"(?<=a)b", r"^x(?!.*--)y$"])
def test_lookaheads_elsewhere_left(pattern):
    from replicas.regex_complement import without_lookaheads
    with pytest.raises(Unsupported):
        without_lookaheads(pattern)


@pytest.mark.parametrize("pattern,names", [
    (r"^line[1-3]$", ("line1", "line2", "line3")),
    (r"^(foo|bar)?$", ("", "bar", "foo")),
    (r"^\d$", tuple("0123456789")),           # Python's Unicode digits are not every reading's
    (r"^[a-c]{2}$", ("aa", "ab", "ac", "ba", "bb", "bc", "ca", "cb", "cc")),
    (r"line[1-3]", None),                     # searched: line1 inside any text
    (r"^x[0-9]+$", None), (r"^[^a]$", None), (r"^[a-z]{3}$", None),   # infinite, or past the limit
    (r"^(a)\1$", None),                       # a back-reference: not read here
])
def test_finite_names_are_every_name_each_reading_matches(pattern, names):
    from replicas.regex_complement import finite_names
    assert finite_names(pattern, 64) == names
    for name in names or ():
        assert re.search(pattern, name) and re.search(pattern, name, re.ASCII)
