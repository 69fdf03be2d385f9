"""The patterns that stand for formats (``replicas.grammar._FORMAT_PATTERNS``) are sound: every
string they take (within the format's length bound) passes ``jsonschema``'s checker for that
format. The grammars write these patterns in place of the formats, and the ``oneOf`` / ``not``
rewrites reason on them (``schema_oneof``: "every IPv4 address is a hostname"), so a pattern wider
than its checker would let an invalid instance through."""

import ipaddress

import jsonschema
import pytest
from hypothesis import given, settings, strategies as st

from replicas.grammar import _FORMAT_MAX_LENGTH, _FORMAT_PATTERNS
from replicas.schema_oneof import IPV4_PATTERN

CHECKERS = {name: jsonschema.Draft202012Validator.FORMAT_CHECKER for name in _FORMAT_PATTERNS}
CHECKERS["host-name"] = jsonschema.Draft3Validator.FORMAT_CHECKER   # draft 3's name for hostname
FORMATS = sorted(f for f in _FORMAT_PATTERNS if f != "regex")      # (regex: tests/replicas/test_format_regex.py)


def test_every_format_pattern_has_an_active_checker():
    """A checker that is not installed passes everything, and the property below would hold
    vacuously (jsonschema's date-time needs rfc3339-validator, hostname needs fqdn, ...)."""
    for name in FORMATS:
        checker = CHECKERS[name]
        assert name in checker.checkers, name
        assert not checker.conforms("\x00 not a " + name, name), name


@pytest.mark.parametrize("name", FORMATS)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_strings_a_format_pattern_takes_pass_the_checker(name, data):
    limit = _FORMAT_MAX_LENGTH.get(name, 10_000)
    s = data.draw(st.from_regex(_FORMAT_PATTERNS[name], fullmatch=True)
                  .filter(lambda x: len(x) <= limit and not x.endswith("\n")))
    assert CHECKERS[name].conforms(s, name), (name, s)


@settings(max_examples=300, deadline=None)
@given(st.ip_addresses(v=4))
def test_every_ipv4_address_is_a_hostname_by_pattern_and_by_checker(address):
    """``schema_oneof`` drops ``{format: ipv4, not: {format: hostname}}`` as empty: sound only if
    each IPv4 address matches the hostname pattern and passes the hostname checker."""
    import re
    s = str(address)
    assert re.fullmatch(IPV4_PATTERN.strip("^$"), s)
    assert re.fullmatch(_FORMAT_PATTERNS["hostname"], s)
    assert jsonschema.Draft202012Validator.FORMAT_CHECKER.conforms(s, "hostname")
    assert ipaddress.IPv4Address(s)
