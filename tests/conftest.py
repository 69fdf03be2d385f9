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
