"""Compact Llama-family decoder (Llama, Qwen2, Qwen3) that loads Hugging Face checkpoints.

The model computes projections, RoPE and MLPs; attention over the KV cache is delegated to an
``attention`` callable supplied per forward (the model runner binds it to the KV store), so the
same definition serves prefill, decode, tensor parallelism and every KV policy unchanged.

Shapes: the forward takes a flat token batch ``input_ids [T]`` (int64) with ``positions [T]``
(each token's true position in its sequence) and returns ``hidden [T, hidden_size]``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn
import torch.nn.functional as F

# attention(layer_index, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]; k is after RoPE.
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

SUPPORTED_ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama",
                           "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "llama"}


LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class UnsupportedModelError(ValueError):
    """A checkpoint whose architecture or settings this engine does not implement."""


@dataclass(frozen=True)
class ModelConfig:
    """Decoder hyper-parameters, read from a Hugging Face ``config.json``."""
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qk_norm: bool = False          # Qwen3: RMSNorm on q and k per head, before RoPE
    attention_bias: bool = False   # Qwen2: bias on q, k, v (not o)
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Llama 3.1's RoPE frequency scaling: (factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings); empty: unscaled
    llama3_rope: tuple[float, ...] = ()

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(f"num_heads {self.num_heads} is not a multiple of "
                                        f"num_kv_heads {self.num_kv_heads}")

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        archs = hf.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(f"architectures {archs} not supported; "
                                        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        _refuse_unsupported(hf, arch)
        rope_scaling = hf.get("rope_scaling") or (hf.get("rope_parameters") or {})
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        if rope_type not in ("default", None, "llama3"):
            raise UnsupportedModelError(f"rope scaling {rope_scaling} is not supported (only the "
                                        f"default and Llama 3.1's 'llama3')")
        llama3_rope = ()
        if rope_type == "llama3":
            try:
                llama3_rope = tuple(float(rope_scaling[k]) for k in LLAMA3_ROPE_KEYS)
            except (KeyError, TypeError, ValueError):
                raise UnsupportedModelError(f"llama3 rope scaling {rope_scaling} needs numbers "
                                            f"{', '.join(LLAMA3_ROPE_KEYS)}") from None
        theta = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        eos = hf.get("eos_token_id")
        num_heads = hf["num_attention_heads"]
        return cls(
            architecture=arch, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
            num_heads=num_heads, num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads, rope_theta=float(theta),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get("max_position_embeddings", 4096), llama3_rope=llama3_rope,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has q / k / v biases (transformers ignores its config's attention_bias)
            qk_norm=arch == "qwen3", attention_bias=arch == "qwen2",
            eos_token_ids=tuple(eos if isinstance(eos, list) else ([eos] if eos is not None else [])))


def _refuse_unsupported(hf: dict, arch: str) -> None:
    """Raise UnsupportedModelError naming each setting of a Hugging Face config that this
    decoder does not implement (it would otherwise load and compute something else)."""
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {hf['hidden_act']!r} (only silu)")
    if hf.get("mlp_bias"):
        problems.append("mlp_bias (MLP projections with biases)")
    if arch != "qwen2" and hf.get("attention_bias"):
        problems.append("attention_bias on q / k / v / o (only Qwen2's q / k / v biases)")
    if hf.get("use_sliding_window") or (arch == "llama" and hf.get("sliding_window")):
        problems.append(f"sliding-window attention (sliding_window {hf.get('sliding_window')})")
    other_layers = sorted({t for t in hf.get("layer_types") or [] if t != "full_attention"})
    if other_layers:
        problems.append(f"layer_types {other_layers} (only full_attention)")
    if problems:
        raise UnsupportedModelError(f"{hf.get('architectures')} with " + "; ".join(problems)
                                    + " is not supported")


class PackedLinear(nn.Module):
    """A bias-optional linear layer whose weight is prepacked in oneDNN's blocked layout, for the
    CPU: ``y [..., out] = x [..., in] @ weight.T (+ bias)``, float32.

    PyTorch's ``F.linear`` on the CPU runs a BLAS GEMM over the row-major weight, slow with the
    few rows of a decode step: the embedded model's forward without attention at batch 8 took
    1.35x-1.56x as long with ``F.linear`` as prepacked (7.76 against 5.20 ms with 24 MiB of KV
    read between steps), a 512-token prefill 1.00x-1.23x (``python -m bench.linear_layout``,
    four runs on this project's 2-core AMD EPYC). vLLM's CPU backend and inductor's ``freezing``
    prepack the same way (``torch.ops.mkldnn._reorder_linear_weight``). Results differ from
    ``F.linear``'s by float rounding (logits by at most 1.0e-5 in those runs), not more.

    ``weight`` (the row-major parameter) stays for TorchDynamo, which cannot trace oneDNN's
    opaque tensors: inside a compiled graph the layer is ``F.linear``, which inductor's
    ``freezing`` (on in ``replicas.decode_graph``) prepacks the same way. So the CPU holds the
    projection weights twice in eager mode and three times with the compiled decode graph.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def prepack_linears(model: nn.Module) -> int:
    """Replace every float32 ``nn.Linear`` of ``model`` on the CPU with a :class:`PackedLinear`;
    a no-op for other devices and dtypes (oneDNN's bfloat16 GEMM needs CPU instructions many
    machines lack) and where PyTorch was built without oneDNN.
    Call it after tensor-parallel sharding (it packs the weights as they are then).
    Returns the number of layers packed."""
    if not torch.backends.mkldnn.is_available():
        return 0
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children()
               if type(child) is nn.Linear and child.weight.device.type == "cpu"
               and child.weight.dtype == torch.float32]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalized in float32, scaled in the input dtype, as Hugging Face's Llama / Qwen3
        # RMSNorm; PyTorch's fused op (one call instead of five: 8 against 11 us at decode shapes).
        if x.dtype == torch.float32:   # the weight inside the fused op: the same values, one pass less
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                    high_freq_factor: float, original_context: float) -> torch.Tensor:
    """Llama 3.1's RoPE scaling of ``inv_freq [head_dim / 2]``: wavelengths longer than
    ``original_context / low_freq_factor`` slowed by ``factor``, shorter than ``original_context /
    high_freq_factor`` kept, interpolated between (Meta's Llama 3.1 reference code; transformers'
    ``rope_type: llama3``)."""
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original_context / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    medium = (wavelen >= original_context / high_freq_factor) & (wavelen <= original_context / low_freq_factor)
    return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 llama3_rope: tuple[float, ...] = ()):
    """``cos, sin`` of shape ``[T, 1, head_dim]`` for integer ``positions [T]``, as
    :func:`apply_rope` takes them: Hugging Face's "rotate half" layout, the first half of ``sin``
    negated (``cos = [c, c]``, ``sin = [-s, s]``); ``llama3_rope``: ``ModelConfig.llama3_rope``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                             device=positions.device) / head_dim))
    if llama3_rope:
        inv_freq = llama3_inv_freq(inv_freq, *llama3_rope)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    sin = emb.sin()
    sin[:, :head_dim // 2].neg_()
    return emb.cos().to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` by ``cos, sin [T, 1, D]`` from :func:`rope_cos_sin`: Hugging Face's
    ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x2, x1]``, computed as ``x * cos
    + [x2, x1] * [-s, s]`` (the same products, so the same float32 values) in three passes and
    one copy instead of six (0.5 against 6.3 ms for ``[5461, 8, 32]`` on this project's 2-core
    CPU; it was the largest share of a 2,048-token prefill's time outside attention and the
    projections)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([x[..., half:], x[..., :half]], dim=-1)
    return (x * cos).add_(rotated.mul_(sin))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal self-attention of one sequence: ``q [T, Hq, D]`` over ``k, v [T, Hkv, D]`` (GQA),
    returns ``[T, Hq, D]``.

    SDPA gets 4-D inputs: with 3-D ones PyTorch 2.13 on the CPU skips its fused kernel for the
    math one (8x slower at 2,048 tokens on this project's 2-core machine).
    """
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], is_causal=True, enable_gqa=True)
    return out[0].transpose(0, 1)


def prefix_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            prior_k: torch.Tensor, prior_v: torch.Tensor) -> torch.Tensor:
    """A prompt chunk's attention: ``q, k, v [c, H, D]`` (Hq query heads, Hkv KV heads) see every
    earlier entry ``prior_k, prior_v [P, Hkv, D]`` (all at positions before the chunk, in any
    order) and, causally, the chunk itself. Returns ``[c, Hq, D]``."""
    if not prior_k.shape[0]:
        return causal_attention(q, k, v)
    c, p = q.shape[0], prior_k.shape[0]
    keys = torch.cat([prior_k.to(k.dtype), k]).transpose(0, 1)[None]
    values = torch.cat([prior_v.to(v.dtype), v]).transpose(0, 1)[None]
    mask = torch.ones(c, p + c, dtype=torch.bool, device=q.device)
    mask[:, p:] = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=mask,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


def decode_steps_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kept_positions: torch.Tensor,
                           kept_k: torch.Tensor, kept_v: torch.Tensor, start: int) -> torch.Tensor:
    """Attention of ``c`` consecutive new tokens at positions ``start .. start + c - 1`` as ``c``
    decode steps of one token each would compute it: token ``j`` (``q, k, v [c, H, D]``) sees the
    cache's kept entries (``kept_positions [P]``, ``kept_k, kept_v [P, Hkv, D]``, as stored: a
    compressed cache's chunk tokens may be quantized or absent) at positions before its own, and
    its own fresh key and value. Returns ``[c, Hq, D]``."""
    c = q.shape[0]
    qpos = torch.arange(start, start + c, device=q.device)
    mask = torch.cat([kept_positions.to(q.device)[None, :] < qpos[:, None],
                      torch.eye(c, dtype=torch.bool, device=q.device)], dim=1)
    keys = torch.cat([kept_k.to(k.dtype), k]).transpose(0, 1)[None]
    values = torch.cat([kept_v.to(v.dtype), v]).transpose(0, 1)[None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # set by tensor parallel

    def forward(self, x, cos, sin, attention: AttentionFn):
        T = x.shape[0]
        # Head counts come from the weights so a tensor-parallel shard needs no other change.
        q = self.q_proj(x).view(T, -1, self.head_dim)
        k = self.k_proj(x).view(T, -1, self.head_dim)
        v = self.v_proj(x).view(T, -1, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.o_proj(attention(self.layer_index, q, k, v).reshape(T, -1))
        return self.reduce(out) if self.reduce else out


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x):
        if torch.is_grad_enabled():
            h = F.silu(self.gate_proj(x)) * self.up_proj(x)
        else:   # serving: in place, the same values with one [T, intermediate] buffer fewer
            h = F.silu(self.gate_proj(x), inplace=True).mul_(self.up_proj(x))
        out = self.down_proj(h)
        return self.reduce(out) if self.reduce else out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_index)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attention):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Llama / Qwen2 / Qwen3 causal LM; parameter names match Hugging Face checkpoints."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attention: AttentionFn) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` for flat ``input_ids [T]`` at ``positions [T]``."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype,
                                self.config.llama3_rope)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attention)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, vocab]`` float32 logits for ``hidden [N, hidden]``."""
        return self.lm_head(hidden).float()


def load_model(path: str | Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> CausalLM:
    """Load a Hugging Face checkpoint folder (config.json + *.safetensors).

    Raises:
        FileNotFoundError: no config.json or no safetensors file in ``path``.
        UnsupportedModelError: an architecture or option this engine does not implement.
        ValueError: weights missing from or unexpected in the checkpoint (names listed).
    """
    from safetensors.torch import load_file
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    with torch.device("meta"):
        model = CausalLM(cfg)
    state = {}
    for f in files:
        state.update(load_file(f))
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = {k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    missing, unexpected = expected - state.keys(), state.keys() - expected
    unexpected = {k for k in unexpected if "rotary_emb" not in k}
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match {cfg.architecture}: missing "
                         f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device).eval()
