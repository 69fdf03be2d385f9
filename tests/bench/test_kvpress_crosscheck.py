"""bench.kvpress_crosscheck: clear errors when the kvpress side cannot run (kvpress itself lives
in its own virtual environment, not installed by the tests)."""

import sys

import pytest

from bench import kvpress_crosscheck


def test_needs_a_kvpress_python(capsys):
    with pytest.raises(SystemExit) as e:
        kvpress_crosscheck.main(["--limit", "1"])
    assert e.value.code == 2 and "--kvpress-python is required" in capsys.readouterr().err


def test_missing_interpreter(tmp_path, capsys):
    assert kvpress_crosscheck.main(["--kvpress-python", str(tmp_path / "nope"), "--limit", "1"]) == 1
    assert "cannot run --kvpress-python" in capsys.readouterr().err


def test_interpreter_without_kvpress(capsys):
    """This environment has no kvpress: the worker fails and the error says so."""
    pytest.importorskip("torch")
    try:
        import kvpress  # noqa: F401
        pytest.skip("kvpress is installed here")
    except ImportError:
        pass
    assert kvpress_crosscheck.main(["--kvpress-python", sys.executable, "--limit", "1", "--out", "/nonexistent"]) == 1
    err = capsys.readouterr().err
    assert "kvpress worker failed" in err and "No module named 'kvpress'" in err


def test_our_pyramidkv_allocation_is_the_prefill_split():
    """The allocation row the tool prints: B tokens per layer on average, decreasing with depth,
    no layer above the prompt (the surplus refilled into the others)."""
    for n, b in ((2880, 512), (2880, 1536), (295, 128)):
        layers = kvpress_crosscheck.our_allocation(6, n, b)
        assert sum(layers) == 6 * b and layers == sorted(layers, reverse=True) and layers[0] <= n
        assert layers[-1] >= 64 and layers[0] > layers[-1]
    assert kvpress_crosscheck.our_allocation(6, 2880, 1536)[0] == 2880
