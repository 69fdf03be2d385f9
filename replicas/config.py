"""Engine configuration."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs to start.

    Attributes:
        model: local Hugging Face checkpoint folder (None: the embedded model).
        device: "cpu", "cuda", "cuda:N" or "auto" (CUDA when available).
        dtype: "float32", "bfloat16", "float16" or "auto" (float32 on CPU, bfloat16 on CUDA).
        kv_cache_bytes: KV pool budget in bytes (pages and block-table entries, all precisions).
        block_size: tokens per KV page.
        max_num_seqs: sequences decoded together.
        max_num_batched_tokens: prompt tokens prefilled per step.
        enable_chunked_prefill: prefill a prompt longer than ``max_num_batched_tokens`` over
            several steps, alternating with decode steps, so running streams are not stalled
            for a whole long prompt (vLLM's option of the same name).
        enable_prefix_caching: share the KV pages of identical prompt prefixes between requests
            (vLLM's automatic prefix caching; ``replicas/prefix_cache.py``): a request whose
            prompt starts with cached pages is prefilled from after them. Compressing policies
            keep their decisions (their prompt attends to a full-precision shadow of the cached
            prefix); PASK's compressed prefix is shared between requests too. Not with
            ``tensor_parallel_size`` > 1 (ValueError at start).
        enable_jump_forward: where the grammar forces the next text (a tool call's scaffold, a
            key, the rest of an enum value), draft its tokens, feed them with the next step as
            one chunk and keep those the model samples itself (speculative verification), so
            they take no decode step each (``replicas/jump_forward.py``,
            ``LLMEngine._verify_draft``). Outputs are those of decoding one token per step
            (greedy and seeded sampling; up to float rounding). Only for policies that take
            generated tokens as a chunk (``PolicySpec.forced_chunks``: full KV, PASK,
            compilerkv+pask; the others decode forced tokens one step each) and requests
            without logprobs, stop strings or stop token ids (``docs/results/jump_forward.md``).
        max_model_len: longest prompt + output in tokens (None: the model's context length).
        kv_policy: KV policy name (see ``replicas.policy.POLICIES``).
        kv_policy_args: keyword arguments of the policy.
        kv_budget: default total KV budget per request, in (0, 1].
        tensor_parallel_size: ranks the model is split over.
        grammar_timeout_s: time bound of one grammar compilation.
        grammar_memory_bytes: resident-memory bound of the grammar compiler process.
        seed: seed of the engine's sampling generator.
        enforce_eager: run the decode forward eagerly (True, the default) or as one compiled
            graph (False: ``replicas/decode_graph.py``; on CUDA with CUDA graphs per batch
            bucket). Compiling takes tens of seconds at the first decode step (inductor caches
            it on disk); needs ``tensor_parallel_size`` 1. On the CPU the graph's step was 5.1 ms
            against 6.6-7.1 ms eager (embedded model, batch 8, 512-token prompts, 2026-12-04,
            ``docs/results/throughput_policies.md``).
    """
    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    kv_cache_bytes: int = 1 << 30
    block_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = False
    enable_prefix_caching: bool = False
    enable_jump_forward: bool = False
    max_model_len: int | None = None
    kv_policy: str = "full"
    kv_policy_args: dict = field(default_factory=dict)
    kv_budget: float = 1.0
    tensor_parallel_size: int = 1
    grammar_timeout_s: float = 10.0
    grammar_memory_bytes: int = 3 << 30
    seed: int = 0
    enforce_eager: bool = True

    def __post_init__(self):
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if not 0.0 < self.kv_budget <= 1.0:
            raise ValueError(f"kv_budget must be in (0, 1], got {self.kv_budget}")
        if self.kv_cache_bytes <= 0 or self.block_size < 1 or self.tensor_parallel_size < 1:
            raise ValueError(f"kv_cache_bytes, block_size and tensor_parallel_size must be positive: {self}")
        if not self.enforce_eager and self.tensor_parallel_size > 1:
            raise ValueError("enforce_eager=False (the compiled decode graph) needs tensor_parallel_size 1, "
                             f"got {self.tensor_parallel_size}")
