"""bench.prefill_coverage: the request span it locates, the per-layer recall it reports."""

import json

import pytest

from bench import accuracy, prefill_coverage


def test_request_span_is_the_request_paragraph():
    from transformers import AutoTokenizer
    from models import EMBEDDED_MODEL_DIR
    tok = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    item = accuracy.load_items("test", ["long_context"])[0]
    span = prefill_coverage.request_span(tok, item)
    ids = tok.apply_chat_template(item.messages, tools=item.tools, add_generation_prompt=True,
                                  return_dict=True)["input_ids"]
    text = tok.decode([ids[i] for i in span.tolist()])
    assert text.startswith("Request:") and "\n\n" not in text.strip()
    assert span.tolist() == list(range(int(span[0]), int(span[-1]) + 1))   # one contiguous run
    short = accuracy.load_items("test", ["simple"])[0]
    with pytest.raises(ValueError, match="no 'Request: ' paragraph"):
        prefill_coverage.request_span(tok, short)


def test_oracle_keeps_the_request_in_every_layer(tmp_path, capsys):
    assert prefill_coverage.main(["--limit", "2", "--prefill-tokens", "256", "--max-tokens", "4",
                                  "--rows", "compilerkv", "oracle-request", "oracle-request-layers-5",
                                  "--out", str(tmp_path), "--name", "c"]) == 0
    rows = {r["row"]: r for r in json.loads((tmp_path / "c.json").read_text())["rows"]}
    assert rows["oracle-request"]["request_recall"] == pytest.approx([1.0] * 6)
    assert rows["oracle-request-layers-5"]["request_recall"][5] == pytest.approx(1.0)
    # the other layers rank by CompilerKV's own score, as the plain row does
    assert rows["oracle-request-layers-5"]["request_recall"][:5] == pytest.approx(rows["compilerkv"]["request_recall"][:5])
    assert all(r["kv_ratio_max"] < 0.25 for r in rows.values())
    assert 0.0 <= rows["compilerkv"]["gate_decides"] <= 1.0 and 0.0 < rows["compilerkv"]["gate_asks"] <= 1.0
    assert rows["oracle-request"]["gate_decides"] == 0.0      # T = 1 in every oracle layer
    assert "| oracle-request |" in (tmp_path / "c.md").read_text()
    with pytest.raises(SystemExit):
        prefill_coverage.main(["--rows", "full"])
    assert "not a prompt compressor" in capsys.readouterr().err


def test_row_settings():
    assert prefill_coverage.resolve_row("compilerkv@kernel=9,window=64") == ("compilerkv", {"kernel": 9, "window": 64})
    assert prefill_coverage.resolve_row("compilerkv-no-gate@kernel=3") == ("compilerkv", {"use_gate": False, "kernel": 3})
    assert prefill_coverage.resolve_row("oracle-request-layers-4,5", 6) == ("oracle-request", {"oracle_layers": (4, 5)})
    assert prefill_coverage.resolve_row("snapkv@kernel_size=21") == ("snapkv", {"kernel_size": 21})
    # Found by a new-user pass: each of these passed the check and crashed after the model loaded.
    for row, msg in (("compilerkv@kernel", "key=number"), ("compilerkv@kernel=wide", "key=number"),
                     ("compilerkv@kernel=4", "positive odd int"), ("compilerkv@kernel=9.5", "positive odd int"),
                     ("compilerkv@nosuch=3", "unexpected keyword argument 'nosuch'"),
                     ("snapkv@kernel_size=-1", "kernel_size must be a positive odd int"),
                     ("compilerkv@prefill_tokens=5", "with --prefill-tokens"),
                     ("pask", "not a prompt compressor"), ("compilerkv+pask", "not a prompt compressor"),
                     ("full", "not a prompt compressor"), ("oracle-requestx", "not a prompt compressor"),
                     ("oracle-request-layers-9", "layers in 0..5"), ("oracle-request-layers--1", "layers in 0..5"),
                     ("oracle-request-layers-x", "layers in 0..5")):
        with pytest.raises(ValueError, match=msg) as e:
            prefill_coverage.resolve_row(row, 6)
        assert repr(row) in str(e.value)


def test_bad_rows_refused_before_any_work(capsys):
    with pytest.raises(SystemExit) as e:
        prefill_coverage.main(["--rows", "compilerkv", "compilerkv@kernel=4"])
    assert e.value.code == 2 and "row 'compilerkv@kernel=4'" in capsys.readouterr().err
