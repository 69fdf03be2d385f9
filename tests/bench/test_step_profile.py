"""bench.step_profile runs end to end on the embedded model and reports a decode step."""

import json

from bench import step_profile


def test_step_profile_reports_a_decode_step(tmp_path, capsys):
    out = tmp_path / "row.json"
    assert step_profile.main(["--batch", "2", "--prompt-len", "48", "--steps", "2", "--top", "5",
                              "--kv-cache-gib", "0.05", "--json", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row["batch"] == 2 and row["device"] == "cpu" and row["graph_steps"] is None
    assert row["step_ms_median"] > 0 and row["python_calls_per_step"] > 100
    # two sequences of 48 prompt tokens plus their generated tokens, every layer, at full KV
    assert row["kv_bytes"] > 0
    assert "function calls" in capsys.readouterr().out
