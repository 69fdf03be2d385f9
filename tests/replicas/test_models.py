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


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")
def test_prepacked_projections_compute_what_f_linear_does():
    from replicas.models.llama import PackedLinear, prepack_linears
    path = resolve_checkpoint()
    plain, packed = load_model(path), load_model(path)
    cfg = plain.config
    assert prepack_linears(packed) == 7 * cfg.num_layers + 1        # q k v o gate up down, lm_head
    assert not any(type(m) is torch.nn.Linear for m in packed.modules())
    assert packed.lm_head.weight is packed.model.embed_tokens.weight   # still tied
    for n in (1, 8, 37):                   # a decode row, a decode batch, a prompt
        ids, pos = torch.randint(0, cfg.vocab_size, (n,)), torch.arange(n)
        with torch.no_grad():
            got = packed.logits(packed(ids, pos, dense_causal_attention))
            ref = plain.logits(plain(ids, pos, dense_causal_attention))
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    lin = torch.nn.Linear(16, 24)           # with a bias, as Qwen2's q / k / v
    x = torch.randn(5, 3, 16)
    with torch.no_grad():
        torch.testing.assert_close(PackedLinear(lin)(x), lin(x))
    assert prepack_linears(load_model(path, dtype=torch.bfloat16)) == 0   # float32 only


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "missing")


MIXED_TEXT = ('Weather in 北京 and Москва? {"city": "Paris", "days": 12} 🙂\n'
              "def f(x):\n    return x ** 2  # done")


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory, vocab_cache):
    """family -> a tiny random checkpoint with the family's real vocabulary (models.random_checkpoint)."""
    from models.random_checkpoint import random_checkpoint
    out = {}

    def get(family):
        if family == "llama3":
            pytest.importorskip("quicktok", reason="Llama 3's ranks ship in quicktok-v1 (extra 'llama3')")
        if family not in out:
            out[family] = random_checkpoint(tmp_path_factory.mktemp(family), family, seed=1)
        return out[family]
    return get


@pytest.mark.parametrize("family,vocab_rows,has_bias,has_qk_norm", [
    ("qwen3", 151936, False, True), ("qwen2.5", 151936, True, False), ("llama3", 128256, False, False)])
def test_family_checkpoints_with_real_vocabularies_match_transformers(family_checkpoints, family, vocab_rows,
                                                                      has_bias, has_qk_norm):
    from tokenizers import Tokenizer
    path = family_checkpoints(family)
    ids = torch.tensor(Tokenizer.from_file(str(path / "tokenizer.json")).encode(MIXED_TEXT).ids)
    assert ids.max() > 100_000      # the text reaches deep into the real vocabulary
    got, ref = ours_vs_hf(path, ids)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    ours = load_model(path)
    assert ours.config.vocab_size == got.shape[-1] == vocab_rows
    attn = ours.model.layers[0].self_attn
    assert (attn.q_proj.bias is not None, hasattr(attn, "q_norm")) == (has_bias, has_qk_norm)


@pytest.fixture(scope="module")
def family_engine(family_checkpoints):
    """family -> an engine on its tiny random checkpoint (closed at the end of the module)."""
    from replicas.config import EngineConfig
    from replicas.engine import LLMEngine
    engines = {}

    def get(family):
        if family not in engines:
            engines[family] = LLMEngine(EngineConfig(model=str(family_checkpoints(family)),
                                                     kv_cache_bytes=16 << 20, max_num_seqs=2))
        return engines[family]
    yield get
    for e in engines.values():
        e.close()


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_engine_serves_family_checkpoint_like_transformers(family_checkpoints, family_engine, family):
    from transformers import AutoModelForCausalLM

    from replicas.sampling_params import SamplingParams
    path, engine = family_checkpoints(family), family_engine(family)
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": MIXED_TEXT}],
                                                  add_generation_prompt=True, return_dict=True)["input_ids"]
    out = engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, len(prompt):].tolist()
    assert out.token_ids == want
    assert out.text == engine.tokenizer.decode(want, skip_special_tokens=True)
    eos = {151645, 151643} if family == "qwen3" else {128001, 128009}
    assert eos <= engine.eos_token_ids


def test_tools_grammar_on_real_qwen3_tool_call_tokens(family_engine):
    """The tools grammar (xgrammar's qwen_3 structural tag) over the real vocabulary: the call is
    opened and closed by the single tokens <tool_call> (151657) and </tool_call> (151658)."""
    from models.chat import parse_tool_calls
    from replicas.grammar import GrammarSpec
    from replicas.sampling_params import SamplingParams
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["unit"], "additionalProperties": False}}}
    engine = family_engine("qwen3")
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Weather, in celsius?"}],
                                                  tools=[tool], add_generation_prompt=True,
                                                  return_dict=True)["input_ids"]
    spec = GrammarSpec("tools", {"tools": [tool], "tool_choice": "required", "parallel_tool_calls": False})
    # A random model picks the grammar's optional whitespace forever: push it down (byte-level
    # spellings of space, newline, tab, CR); where the grammar requires one it still wins.
    blank = [i for t, i in engine.tokenizer.get_vocab().items() if t and set(t) <= set("ĠĊĉč")]
    params = SamplingParams(max_tokens=64, logit_bias=tuple((i, -100.0) for i in blank))
    out = engine.generate([prompt], params, [spec])[0]
    assert out.token_ids.count(151657) == 1 and out.token_ids.count(151658) == 1
    calls, _ = parse_tool_calls(out.text)
    assert [c["name"] for c in calls] == ["get_weather"]
    assert calls[0]["arguments"]["unit"] in ("celsius", "fahrenheit")


@pytest.mark.parametrize("change,match", [
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 4096},
     "sliding-window attention"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 4096}, "sliding-window attention"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding_attention"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "needs numbers"),
])
def test_unsupported_settings_are_named(change, match):
    from replicas.models import ModelConfig
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    ModelConfig.from_hf(hf)   # the base config is fine
    with pytest.raises(UnsupportedModelError, match=match):
        ModelConfig.from_hf({**hf, **change})


def test_llama31_rope_scaling_matches_transformers(tmp_path):
    """Llama 3.1's ``rope_type: llama3`` at settings where it moves most frequencies (a 64-token
    original context), so an unscaled RoPE would not match."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from replicas.models.llama import llama3_inv_freq
    torch.manual_seed(0)
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      rope_parameters=rope)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    assert ours.config.llama3_rope == (8.0, 1.0, 4.0, 64.0)
    inv = 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16)
    assert (llama3_inv_freq(inv, *ours.config.llama3_rope) != inv).sum() >= 4
    got, ref = ours_vs_hf(tmp_path, torch.randint(0, 300, (80,)))
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
