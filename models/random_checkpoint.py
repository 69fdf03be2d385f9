"""Random-weight checkpoints of real model families, with their real vocabularies (no download).

For tests and benchmarks at real shapes: ``random_checkpoint(folder, "qwen3", "4b")`` is a
Qwen3-4B-shaped model; ``"tiny"`` shapes keep every family's structure (GQA, q / k norms,
attention biases, tied embeddings) at hidden size 64. The tokenizer files come from
``models.vocab`` (Qwen2.5 uses Qwen3's files: the same ranks and ids, Qwen3 adds the four
``<tool_response>`` / ``<think>`` tokens at 151,665-151,668).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Family:
    """A model family: its transformers classes, vocabulary and special ids."""
    config_class: str
    model_class: str
    vocab: str               # models.vocab name
    vocab_size: int          # embedding rows (Qwen pads 151,669 tokens to 151,936)
    bos_token_id: int
    eos_token_ids: tuple[int, ...]
    extra: tuple[tuple[str, object], ...] = ()


FAMILIES = {
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", "qwen3", 151_936, 151_643, (151_645, 151_643)),
    "qwen2.5": Family("Qwen2Config", "Qwen2ForCausalLM", "qwen3", 151_936, 151_643, (151_645, 151_643),
                      (("use_sliding_window", False),)),
    "llama3": Family("LlamaConfig", "LlamaForCausalLM", "llama3", 128_256, 128_000, (128_001, 128_009)),
}

# (hidden, intermediate, layers, heads, kv heads, head_dim, rope theta, tied embeddings)
SHAPES = {
    "tiny": (64, 128, 2, 4, 2, 16, 1_000_000.0, True),
    "4b": (2560, 9728, 36, 32, 8, 128, 1_000_000.0, True),    # Qwen3-4B
    "8b": (4096, 14336, 32, 32, 8, 128, 500_000.0, False),    # Llama 3 8B
}


def random_checkpoint(folder: str | Path, family: str = "qwen3", shape: str = "tiny", *,
                      num_layers: int | None = None, seed: int = 0, dtype: str = "float32",
                      device: str = "cpu", max_position_embeddings: int = 4096) -> Path:
    """Write a random-weight checkpoint of ``family`` (``qwen3``, ``qwen2.5``, ``llama3``) at
    ``shape`` (``tiny``, ``4b``, ``8b``) into ``folder``: config.json, model.safetensors,
    generation_config.json and the family's real tokenizer with its chat template.

    Args:
        num_layers: overrides the shape's layer count.
        dtype: weights' dtype, ``float32`` or ``bfloat16``.
        device: where the weights are initialized (``cuda`` is much faster at 4B).

    Raises:
        ValueError: an unknown family or shape.
        models.vocab.VocabularyNotInstalledError: the family's vocabulary package is missing.
    """
    import torch
    import transformers

    from models.vocab import install_tokenizer
    if family not in FAMILIES or shape not in SHAPES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)} and shape one of {sorted(SHAPES)}, "
                         f"got {family!r}, {shape!r}")
    fam = FAMILIES[family]
    hidden, inter, layers, heads, kv_heads, head_dim, theta, tied = SHAPES[shape]
    cfg = getattr(transformers, fam.config_class)(
        vocab_size=fam.vocab_size, hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=num_layers or layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, max_position_embeddings=max_position_embeddings, rope_theta=theta,
        tie_word_embeddings=tied, bos_token_id=fam.bos_token_id, eos_token_id=fam.eos_token_ids[0],
        torch_dtype=dtype, **dict(fam.extra))
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, fam.model_class)(cfg).to(getattr(torch, dtype))
    folder = Path(folder)
    model.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": fam.bos_token_id, "eos_token_id": list(fam.eos_token_ids)}))
    install_tokenizer(folder, fam.vocab)
    return folder
