"""Model definitions that load Hugging Face checkpoints."""

from replicas.models.llama import (AttentionFn, CausalLM, ModelConfig, UnsupportedModelError,
                                   load_model)

__all__ = ["AttentionFn", "CausalLM", "ModelConfig", "UnsupportedModelError", "load_model"]
