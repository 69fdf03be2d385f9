"""bench.linear_layout runs end to end on the embedded model: both passes timed, logits compared."""

import pytest
import torch

from bench import linear_layout


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")
def test_linear_layout_prints_both_passes(capsys):
    assert linear_layout.main(["--batch", "2", "--prompt-len", "16", "--calls", "2", "--repeats", "1",
                               "--kv-mib", "0"]) == 0
    out = capsys.readouterr().out
    assert "43 projections prepacked" in out   # 6 layers x 7 and the LM head
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["decode"], ["prefill"])}
    assert set(rows) == {"decode", "prefill"}
    for cells in rows.values():
        plain_ms, packed_ms, ratio, diff = float(cells[1]), float(cells[2]), cells[3], float(cells[4])
        assert plain_ms > 0 and packed_ms > 0 and ratio.endswith("x")
        assert diff < 1e-3   # the same logits up to float rounding
