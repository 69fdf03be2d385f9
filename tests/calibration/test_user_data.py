"""Calibration on the user's data (``--data``): BFCL question files and OpenAI-style JSONL, the
seeded dev / held-out split, scoring with the AST checker, every bad-input case refused before
anything is written, and end-to-end runs whose tables the engine loads."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from calibration.data import CalibrationDataError, CalItem, load_split
from models import EMBEDDED_MODEL_DIR, bfcl, synth

BFCL = bfcl.bfcl_dir()
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "high"]}},
          "required": ["ok", "level"]}


def _bfcl_file(tmp_path: Path, n: int, category: str = "simple_python") -> Path:
    """The first ``n`` questions of a real BFCL category, in BFCL's layout (answers in possible_answer/)."""
    name = f"BFCL_v4_{category}.json"
    (tmp_path / "possible_answer").mkdir(parents=True, exist_ok=True)
    q = (BFCL / name).read_text().splitlines()[:n]
    (tmp_path / name).write_text("\n".join(q) + "\n")
    if (BFCL / "possible_answer" / name).is_file():
        a = (BFCL / "possible_answer" / name).read_text().splitlines()[:n]
        (tmp_path / "possible_answer" / name).write_text("\n".join(a) + "\n")
    return tmp_path / name


def _openai_rows(n_per_cat: int = 2) -> list[dict]:
    """Synthetic test examples written as OpenAI-style JSONL rows (one with the answer as the last
    assistant turn, as OpenAI's fine-tuning files), plus a response_format example."""
    rows = []
    for cat in ("simple", "multiple", "irrelevance"):
        for ex in synth.eval_examples("test", cat)[:n_per_cat]:
            calls = [{"type": "function", "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                     for c in ex.answer]
            rows.append({"id": ex.id, "messages": ex.messages, "tools": ex.tools, "tool_calls": calls})
    rows[0] = {"id": rows[0]["id"], "tools": rows[0]["tools"],
               "messages": rows[0]["messages"] + [{"role": "assistant", "content": None, "tool_calls": rows[0]["tool_calls"]}]}
    rows.append({"id": "json_0", "messages": [{"role": "user", "content": "Report ok with level high."}],
                 "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}},
                 "expected_json": {"ok": True, "level": "high"}})
    return rows


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------------------- loading and the split
def test_bfcl_file_with_answers_beside_it(tmp_path):
    f = _bfcl_file(tmp_path, 10)
    split = load_split(f, dev_fraction=0.6, seed=1)
    src = split.source
    assert src["format"] == "bfcl" and src["answers"] == str(tmp_path / "possible_answer" / f.name)
    assert (src["examples"], src["dev"], src["held_out"]) == (10, 6, 4)
    assert len(src["sha256"]) == 64 and len(src["answers_sha256"]) == 64 and src["seed"] == 1
    ids = set(src["dev_ids"]) | set(src["held_out_ids"])
    assert ids == {f"simple_python_{i}" for i in range(10)} and not set(src["dev_ids"]) & set(src["held_out_ids"])
    first = next(i for i in split.dev + split.held_out if i.id == "simple_python_0")
    assert first.ground_truth[0]["calculate_triangle_area"]["base"] == [10]
    right = '<tool_call>\n{"name": "calculate_triangle_area", "arguments": {"base": 10, "height": 5}}\n</tool_call>'
    assert first.score(right) and not first.score(right.replace("10", "11")) and not first.score("no call")
    # an explicit --answers file, and the irrelevance file that needs none
    other = tmp_path / "elsewhere.json"
    shutil.copy(f, other)
    assert load_split(other, answers=tmp_path / "possible_answer" / f.name, dev_fraction=0.6, seed=1).source["dev_ids"] == src["dev_ids"]
    irr = load_split(_bfcl_file(tmp_path, 4, "irrelevance"), seed=0)
    assert irr.source["answers"] is None and all(i.category == "irrelevance" and i.ground_truth == [] for i in irr.dev)


def test_openai_jsonl_forms_and_scoring(tmp_path):
    f = _write_jsonl(tmp_path / "dev.jsonl", _openai_rows())
    split = load_split(f, dev_fraction=0.5, seed=0, limit=7)
    items = {i.id: i for i in split.dev + split.held_out}
    assert split.source["format"] == "openai" and split.source["examples"] == 7 and split.source["answers"] is None
    simple = synth.eval_examples("test", "simple")[0]
    it = items[simple.id]             # its answer was the last assistant turn: removed from the prompt
    assert it.messages == simple.messages and it.category == "simple" and it.tools == simple.tools
    from models.chat import render_answer
    assert it.score(render_answer(simple.answer))
    wrong = dict(simple.answer[0], arguments={k: "zz" for k in simple.answer[0]["arguments"]})
    assert not it.score(render_answer([wrong]))
    irr = items[synth.eval_examples("test", "irrelevance")[0].id]
    assert irr.category == "irrelevance" and irr.score("None of the functions fit.") and not irr.score(render_answer(simple.answer))
    assert items[synth.eval_examples("test", "multiple")[0].id].category == "multiple"
    js = load_split(f, seed=0).dev + load_split(f, seed=0).held_out
    j = next(i for i in js if i.id == "json_0")
    assert j.category == "json" and j.grammar().kind == "json_schema" and j.tools is None
    assert j.score('{"ok": true, "level": "high"}') and not j.score('{"ok": false, "level": "high"}')
    assert not j.score('{"ok": true')


def test_split_is_seeded():
    f = BFCL / "BFCL_v4_simple_python.json"
    a, b = load_split(f, seed=3, limit=20), load_split(f, seed=3, limit=20)
    assert a.source == b.source and [i.id for i in a.dev] == [i.id for i in b.dev]
    c = load_split(f, seed=4, limit=20)
    assert c.source["dev_ids"] != a.source["dev_ids"] and sorted(c.source["dev_ids"] + c.source["held_out_ids"]) == \
        sorted(a.source["dev_ids"] + a.source["held_out_ids"])
    assert load_split(f, seed=3, limit=20, dev_fraction=0.25).source["dev"] == 5


@pytest.mark.parametrize("case", ["missing", "bad_json", "no_answer", "no_answer_bfcl", "no_answer_file", "empty_split",
                                  "empty_file", "unknown_tool", "bad_messages", "json_mismatch", "neither",
                                  "bad_argument", "unscorable"])
def test_bad_data_is_a_clear_error(tmp_path, case):
    rows = _openai_rows(1)
    expected = {"missing": "data file not found", "bad_json": ":3: not valid JSON",
                "no_answer": ":2: no expected answer", "no_answer_bfcl": "no expected answer for id 'simple_python_1'",
                "no_answer_file": "answer file not found", "empty_split": "leave no held-out example",
                "empty_file": "no examples", "unknown_tool": "calls 'nope', which is not among the tools",
                "bad_messages": ":1: messages[0].content must be a string",
                "json_mismatch": "'expected_json' does not follow the schema",
                "neither": "give either 'tools'",
                "bad_argument": ":2: the expected answer does not pass the checker against the example's own tools",
                "unscorable": ":4: the checker cannot score this example (unknown BFCL type"}[case]
    f, kw = tmp_path / "data.jsonl", {}
    if case == "missing":
        f = tmp_path / "nope.jsonl"
    elif case == "bad_json":
        _write_jsonl(f, rows[:2] + ['{"messages": [}'])
    elif case == "no_answer":
        del rows[1]["tool_calls"]
        _write_jsonl(f, rows)
    elif case in ("no_answer_bfcl", "no_answer_file"):
        f = _bfcl_file(tmp_path, 3)
        answers = tmp_path / "possible_answer" / f.name
        if case == "no_answer_file":
            answers.unlink()
        else:
            answers.write_text("\n".join(answers.read_text().splitlines()[:1]) + "\n")
    elif case == "empty_split":
        _write_jsonl(f, rows[:2])
        kw = {"dev_fraction": 0.9}
    elif case == "empty_file":
        f.write_text("\n\n")
    elif case == "unknown_tool":
        rows[1]["tool_calls"] = [{"type": "function", "function": {"name": "nope", "arguments": "{}"}}]
        _write_jsonl(f, rows)
    elif case == "bad_messages":
        rows[0]["messages"] = [{"role": "user", "content": [{"type": "image_url"}]}]
        _write_jsonl(f, rows)
    elif case == "json_mismatch":
        rows[-1]["expected_json"] = {"ok": "yes", "level": "high"}
        _write_jsonl(f, rows)
    elif case == "bad_argument":
        rows[1]["tool_calls"][0]["function"]["arguments"] = json.dumps({"not_a_parameter": 1})
        _write_jsonl(f, rows)
    elif case == "unscorable":
        rows[-1]["response_format"]["json_schema"]["schema"] = {
            "type": "object", "properties": {"ok": {"type": ["boolean", "null"]}, "level": {"enum": ["low", "high"]}}}
        _write_jsonl(f, rows)
    elif case == "neither":
        rows[1].pop("tools")
        _write_jsonl(f, rows)
    with pytest.raises(CalibrationDataError, match=expected.replace("(", r"\(").replace("[", r"\[")) as e:
        load_split(f, **kw)
    if case not in ("missing", "empty_split", "empty_file", "no_answer_file", "no_answer_bfcl"):
        assert str(f) in str(e.value)      # names the file (and the line, checked by the pattern)


@pytest.mark.parametrize("command", ["pask", "compilerkv"])
def test_cli_bad_data_writes_nothing(tmp_path, capsys, command):
    from calibration.__main__ import main
    bad = _write_jsonl(tmp_path / "bad.jsonl", [_openai_rows(1)[0], "not json"])
    one = _write_jsonl(tmp_path / "one.jsonl", _openai_rows(1)[:1])
    for data, extra, msg in ((tmp_path / "missing.jsonl", [], "data file not found"),
                             (bad, [], f"{bad}:2: not valid JSON"),
                             (one, [], "leave no"),
                             (one, ["--dev-fraction", "1.0"], "dev fraction must be in (0, 1)")):
        out = tmp_path / "out"
        rc = main([command, "--model", str(EMBEDDED_MODEL_DIR), "--out", str(out), "--executor", "local",
                   "--data", str(data), "--no-progress"] + extra)
        assert rc == 2 and msg in capsys.readouterr().err
        assert not out.exists()
    with pytest.raises(SystemExit):
        main([command, "--model", str(EMBEDDED_MODEL_DIR), "--out", str(tmp_path / "out"), "--limit", "3"])
    assert "apply to --data" in capsys.readouterr().err and not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- end to end
# Kept small (one dev example for PASK, whose run is some 60 probes; a few CompilerKV rollouts).
PASK_SMALL = ["--num-groups", "1", "--max-new-tokens", "8", "--distortion-examples", "1", "--no-progress",
              "--executor", "local"]


def _main(*argv) -> int:
    from calibration.__main__ import main
    return main([str(a) for a in argv])


@pytest.mark.slow
def test_compilerkv_on_a_bfcl_file_same_seed_same_tables_and_the_policy_loads_them(tmp_path):
    from calibration.artifacts import load_artifact
    from replicas.policies import CompilerKVPolicy
    f = _bfcl_file(tmp_path / "data", 8)
    arts = {}
    for name in ("a", "b"):
        assert _main("compilerkv", "--model", EMBEDDED_MODEL_DIR, "--out", tmp_path / name, "--data", f, "--limit", 4,
                     "--seed", 5, "--budgets", 64, "--rounds", 1, "--round-size", 4, "--executor", "local",
                     "--no-progress") == 0
        arts[name] = load_artifact(tmp_path / name, "compilerkv", EMBEDDED_MODEL_DIR)
    a, b = arts["a"], arts["b"]
    assert a.tables.keys() == b.tables.keys()
    for t in a.tables:
        assert torch.equal(a.tables[t], b.tables[t]), t
    data = a.meta["data"]
    assert data == b.meta["data"] and data["format"] == "bfcl" and data["path"] == str(f.resolve())
    assert data["answers"] == str((tmp_path / "data" / "possible_answer" / f.name).resolve()) and data["seed"] == 5
    assert (data["examples"], data["dev"], data["held_out"]) == (4, 2, 2)
    assert data["dev_ids"] == load_split(f, seed=5, limit=4).source["dev_ids"]
    assert f"--data {f.resolve()}" in a.meta["build_command"] and "--limit 4" in a.meta["build_command"]
    policy = CompilerKVPolicy(tables=str(tmp_path / "a"))
    policy.bind_model(EMBEDDED_MODEL_DIR)
    assert policy.tables.head_weights.shape == (1, 6, 8)


@pytest.mark.slow
def test_pask_on_an_openai_jsonl_end_to_end_loads_in_the_engine(tmp_path):
    from calibration.artifacts import load_artifact
    from replicas.config import EngineConfig
    from replicas.engine import LLMEngine
    f = _write_jsonl(tmp_path / "dev.jsonl", _openai_rows(1))   # 3 tool-call examples, 1 response_format
    argv = ("pask", "--model", EMBEDDED_MODEL_DIR, "--out", tmp_path / "pask", "--data", f, "--dev-fraction", 0.25,
            *PASK_SMALL)
    assert _main(*argv) == 0
    art = load_artifact(tmp_path / "pask", "pask", EMBEDDED_MODEL_DIR)
    data = art.meta["data"]
    assert data["format"] == "openai" and (data["examples"], data["dev"], data["held_out"]) == (4, 1, 3)
    assert data["dev_ids"] == load_split(f, dev_fraction=0.25).source["dev_ids"] and data["sha256"]
    assert sum(art.meta["sides"]["prompt"]["counts"]) > 0 and 0 < sum(art.meta["sides"]["decode"]["counts"]) <= 8
    eng = LLMEngine(EngineConfig(kv_policy="pask", kv_cache_bytes=8 << 20, max_num_seqs=2))
    eng.load_table("pask", tmp_path / "pask", "user-v1")
    assert eng.table_versions["pask"] == "user-v1" and eng.policy.table.layer_groups == [(0, 6)]
    # the run folder is refused for another split of the data; the artifact stays as it was
    before = (tmp_path / "pask" / "manifest.json").read_text()
    assert _main(*argv, "--seed", 1) == 2
    assert (tmp_path / "pask" / "manifest.json").read_text() == before


@pytest.mark.slow
@pytest.mark.ray
def test_pask_on_user_data_same_table_with_ray_and_local(micro_model, tmp_path, ray_cluster):
    from calibration.executors import LocalExecutor, RayExecutor
    from calibration.pask import Calibrator, PASKCalibrationConfig, ProbeWorker
    split = load_split(_write_jsonl(tmp_path / "dev.jsonl", _openai_rows(1)), dev_fraction=0.25, seed=0)
    cfg = PASKCalibrationConfig(str(micro_model), num_groups=1, distortion_examples=1, max_new_tokens=6,
                                data=split.source["path"], dev_fraction=0.25)
    args = (str(micro_model), [], 0, 1, 6, split.dev)
    runs = {}
    for kind in ("local", "ray"):
        ex = (LocalExecutor(lambda: ProbeWorker(*args)) if kind == "local"
              else RayExecutor(ProbeWorker, args, num_workers=1, num_cpus=0.5))
        try:
            runs[kind] = Calibrator(cfg, tmp_path / kind, ex, progress=False, data=split).run()
        finally:
            ex.close()
    for name in runs["local"].tables:
        assert torch.equal(runs["local"].tables[name], runs["ray"].tables[name]), name
    assert runs["ray"].meta["data"]["dev_ids"] == split.source["dev_ids"]
    assert runs["ray"].meta["sides"]["decode"]["counts"] == runs["local"].meta["sides"]["decode"]["counts"]
