"""A 20-step training smoke run on a micro config: loss falls, export loads, resume continues."""

import json

import pytest


@pytest.mark.slow
def test_micro_training_exports_and_resumes(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models import train
    out, ckpt = tmp_path / "model", tmp_path / "ckpt"
    common = ["--micro", "--out", str(out), "--ckpt-dir", str(ckpt), "--batch-size", "4",
              "--eval-every", "1000", "--lr", "1e-2", "--warmup", "2", "--threads", "1"]
    assert train.main(common + ["--steps", "20"]) == 0
    log = [json.loads(line) for line in (ckpt / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 21))
    first, last = sum(r["loss"] for r in log[:5]) / 5, sum(r["loss"] for r in log[-5:]) / 5
    assert last < first - 0.3, (first, last)

    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.architectures == ["Qwen3ForCausalLM"]
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    assert tok.chat_template and tok.convert_tokens_to_ids("<|im_end|>") == model.config.eos_token_id

    assert train.main(common + ["--steps", "22"]) == 0
    steps = [json.loads(line)["step"] for line in (ckpt / "log.jsonl").read_text().splitlines()]
    assert steps[-2:] == [21, 22]

    # A new machine: no resumable state, only the exported checkpoint.
    fresh = tmp_path / "ckpt2"
    args = [a if a != str(ckpt) else str(fresh) for a in common]
    assert train.main(args + ["--steps", "24", "--init-from", str(out)]) == 0
    steps = [json.loads(line)["step"] for line in (fresh / "log.jsonl").read_text().splitlines()]
    assert steps == [23, 24]


def test_mix_overrides_from_a_step(capsys):
    from types import SimpleNamespace

    from models import train
    args = SimpleNamespace(long_start=3000, long_weight=1.5, mix={"irrelevance": 3.0}, mix_from=5250)
    assert train.mix_at(100, args) == train.SHORT_MIX
    assert train.mix_at(4000, args) == {**train.SHORT_MIX, "long_context": 1.5}
    assert train.mix_at(5250, args) == {**train.SHORT_MIX, "long_context": 1.5, "irrelevance": 3.0}
    for bad, msg in (("nonsense=2", "unknown category"), ("irrelevance=x", "must be a number"),
                     ("irrelevance=-1", ">= 0")):
        with pytest.raises(SystemExit):
            train.main(["--out", "/tmp/unused", "--mix", bad])
        assert msg in capsys.readouterr().err
