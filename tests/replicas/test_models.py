"""Our compact model definitions against transformers' implementations of the same checkpoints."""

import pytest
import torch
import torch.nn.functional as F

from models import resolve_checkpoint
from replicas.models import UnsupportedModelError, load_model


def dense_causal_attention(layer, q, k, v):
    """Single-sequence causal attention with GQA: q [T, Hq, D], k / v [T, Hkv, D]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=True)
    return out.transpose(0, 1)


def ours_vs_hf(path, ids):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_model(path)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        got = ours.logits(ours(ids, torch.arange(len(ids)), dense_causal_attention))
    return got, ref


def test_embedded_qwen3_logits_match_transformers():
    path = resolve_checkpoint()
    ids = torch.randint(0, 4000, (37,))
    got, ref = ours_vs_hf(path, ids)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_random_llama_logits_match_transformers(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                      rope_theta=5000.0, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    got, ref = ours_vs_hf(tmp_path, torch.randint(0, 300, (29,)))
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "missing")
