"""bench.niah: the needle grid, its files, and refused settings."""

import json

import pytest

from bench import niah


def test_needles_move_only_the_request():
    items = niah.needle_items("test", [2500], [0.0, 1.0], 2)
    assert [i.id for i in items] == ["niah_2500_0.0_0", "niah_2500_0.0_1", "niah_2500_1.0_0", "niah_2500_1.0_1"]
    first, last = items[0], items[2]
    assert first.tools == last.tools and first.ground_truth == last.ground_truth
    a, b = first.messages[0]["content"], last.messages[0]["content"]
    assert a != b and sorted(a.split("\n\n")) == sorted(b.split("\n\n"))   # same paragraphs, moved
    assert a.startswith("Request: ") and b.split("\n\n")[-2].startswith("Request: ")


def test_grid_files(tmp_path):
    assert niah.main(["--lengths", "2000", "--depths", "0", "1", "--per-cell", "1", "--policies", "full",
                      "snapkv", "--prefill-tokens", "256", "--max-tokens", "8", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "niah.json").read_text())
    assert set(r["policies"]) == {"full", "snapkv"}
    for p in r["policies"].values():
        assert len(p["grid"]) == 2 and all(len(row) == 1 for row in p["grid"])
    assert r["policies"]["full"]["kv_ratio_max"] == pytest.approx(1.0)
    assert r["policies"]["snapkv"]["kv_ratio_max"] < 0.3          # ~2,000-token prompts cut to 256
    assert len(r["prompt_tokens"]["2000"]) == 2 and min(r["prompt_tokens"]["2000"]) >= 1500
    assert (tmp_path / "niah.png").stat().st_size > 0 and "**snapkv**" in (tmp_path / "niah.md").read_text()


@pytest.mark.parametrize("argv", [["--depths", "1.5"], ["--lengths", "5000"], ["--per-cell", "0"],
                                  ["--policies", "pask"]])
def test_bad_settings(argv):
    with pytest.raises(SystemExit) as e:
        niah.main(argv)
    assert e.value.code == 2


def test_prompts_that_do_not_fit_are_refused_before_work(capsys):
    assert niah.main(["--lengths", "3800", "--depths", "0", "--per-cell", "1", "--max-tokens", "600"]) == 2
    assert "does not fit the model's 4096-token context" in capsys.readouterr().err
