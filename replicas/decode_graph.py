"""The decode forward as one compiled graph (``EngineConfig.enforce_eager=False``).

A decode step's forward reads only the step plan's tensors (token ids, positions, per pool the
slot mapping, block tables and context lengths, the rows whose new token attends to itself), so
it can be compiled once and replayed: no Python runs per layer or per sequence inside it. This
follows vLLM's and nano-vllm's model runners: eager prefill, a compiled / captured decode.

- **CPU**: ``torch.compile(fullgraph=True, dynamic=True)`` (inductor) of the forward; batch size
  and block-table widths are symbolic, the KV pools' dimensions static (``mark_static``: each size
  symbol costs Python calls on every step), so one compile serves every step (batch and width are
  padded to at least 2, as PyTorch specializes dimensions of size 0 and 1). Inductor's C++
  wrapper (``cpp_wrapper``) makes the whole forward one call from Python, where its Python
  wrapper made several per layer and buffer (``docs/results/decode_graph.md``). The first step
  compiles (64 s on two cores for the embedded model with full KV, cold cache, measured beside
  another job; a C++ compiler must be installed).
- **CUDA**: the same function compiled with ``mode="reduce-overhead"`` (inductor + CUDA graphs,
  one graph per distinct input shape): the batch is padded up to a bucket (1, 2, 4, 8, then
  multiples of 8, as vLLM's capture sizes) and the block tables to the widest a sequence can
  have, so there is one graph per bucket. The pools are marked static addresses, so the graphs
  write them in place. *Not yet run on a GPU by this project*: a failure to compile or capture
  falls back to the eager forward for the rest of the engine's life, logged once.

Every pool the policy stores into is attended in every layer (a pool nobody uses in a layer has
context length 0 there), with the static paged-attention reference on the CPU
(:func:`kernels.decode_attention.paged_decode_attention_static`) or the Triton kernel on CUDA,
merged by log-sum-exp with the new tokens' attention to themselves. The KV writes go through
:func:`kernels.kv_store.store_slots` (in place under compilation).

A policy that reads each step's queries (H2O: ``record_decode_queries``) gets them from the
graph as one more output, ``[L, B, Hq, D]``.

Not covered (the step runs eager): steps with prompt chunks or drafts, tensor parallelism, a
batch above ``max_num_seqs``.
"""

from __future__ import annotations

import logging
import types

import torch
import torch._inductor.config
import torch.fx.experimental._config

from kernels import cpu_attention, kv_store
from replicas.kv_cache import DecodePlan, KVCache, attend_pools
from replicas.precision import Precision

logger = logging.getLogger(__name__)


def _own_code(method):
    """``method`` rebound to a function over its own copy of the code object. TorchDynamo keeps
    compiled graphs per code object, at most 8 (``recompile_limit``; then, with ``fullgraph``,
    it raises). With frozen weights each engine's graph is its own, so several engines in one
    process (tests, benchmarks) would spend one budget and keep the dead ones' weights alive."""
    f = method.__func__
    fresh = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    return types.MethodType(fresh, method.__self__)


# Guards TorchDynamo checks before each call of the graph: those on its input tensors (dtype,
# device, rank, static sizes), the symbolic shape relations between them, and the global state
# (grad mode, default device, ...). The rest are on the objects the forward reaches through
# ``self`` (the model's modules, their attributes and hooks, the cache's pools as Python objects:
# about 1,230 guards for the embedded model), which never change once the graph is built: the weights
# are frozen into it, the pools are allocated once. Checking them took about 0.3 ms of a 4 ms
# step (``TorchDynamo Cache Lookup`` 397 -> 98 us per call in torch.profiler, batch 8).
KEPT_GUARDS = frozenset({"TENSOR_MATCH", "SHAPE_ENV", "GRAD_MODE", "GLOBAL_STATE", "DETERMINISTIC_ALGORITHMS",
                         "TORCH_FUNCTION_STATE", "DEFAULT_DEVICE", "AUTOGRAD_SAVED_TENSORS_HOOKS"})


def input_guards_only(entries) -> list[bool]:
    """TorchDynamo ``guard_filter_fn``: keep the guards in :data:`KEPT_GUARDS`, except those on
    parameters (frozen into the graph); drop the guards on modules and other Python objects."""
    return [e.guard_type in KEPT_GUARDS and not isinstance(e.value, torch.nn.Parameter) for e in entries]


def batch_buckets(max_num_seqs: int) -> list[int]:
    """CUDA graph batch sizes: 1, 2, 4, 8, then multiples of 8 up to ``max_num_seqs`` (included)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraph:
    """The engine's compiled decode forward over one rank's model and KV cache.

    Args:
        model: the :class:`replicas.models.CausalLM`.
        kv: the rank's :class:`KVCache`.
        precisions: the pools the policy stores into (``PolicySpec.precisions``); HIGH first.
        max_num_seqs: the largest decode batch.
        record_queries: also return each layer's queries (``PolicySpec.record_decode_queries``).
    """

    def __init__(self, model, kv: KVCache, precisions, max_num_seqs: int, record_queries: bool = False):
        self.model, self.kv = model, kv
        self.record_queries = record_queries
        self.device = kv.device
        self.precisions = tuple(p for p in (Precision.HIGH, Precision.INT8, Precision.INT4) if p in precisions)
        self.with_self = any(p != Precision.HIGH for p in self.precisions)
        self.cuda = self.device.type == "cuda"
        self.buckets = batch_buckets(max_num_seqs)
        bs = kv.cfg.block_size
        self.max_pages = -(-kv.cfg.max_model_len // bs)
        self.failed = False
        self.calls = 0        # steps run through the graph
        # CPU, float32: attention is the fused kernel's operator (kernels.cpu_attention), which the
        # C++ wrapper calls without Python.
        self.fused = not self.cuda and kv.cfg.dtype == torch.float32 and cpu_attention.available()
        for p in self.precisions:
            for t in kv.pools[p].tensors():
                # The pools never change shape: static, so the graph neither guards nor reads
                # their sizes on each call (dynamic=True would make every dimension a symbol).
                torch._dynamo.mark_static(t)
                if self.cuda:
                    torch._dynamo.mark_static_address(t)
        if self.cuda:
            self._compiled = torch.compile(self._forward, fullgraph=True, dynamic=True, mode="reduce-overhead")
        else:   # the C++ wrapper: the whole forward is one call from Python, no call per layer or buffer
            self._compiled = torch.compile(_own_code(self._forward), fullgraph=True, dynamic=True,
                                           options={"cpp_wrapper": True,
                                                    "guard_filter_fn": input_guards_only})

    def supports(self, plan: DecodePlan) -> bool:
        """Whether this step can run through the graph: every pool it reads or writes is one the
        graph attends, and its batch fits a bucket."""
        used = set(plan.slot_mapping) | {p for p, active in plan.active.items() if any(active)}
        return not self.failed and used <= set(self.precisions) and plan.rows.numel() <= self.buckets[-1]

    def _forward(self, ids, positions, slots, tables, lens, self_rows):
        """Logits ``[B, vocab]`` of one decode step, and with ``record_queries`` the queries
        ``[L, B, Hq, D]``; ``slots [P, L, B]`` int64, ``tables``: per pool ``[L, B, W]`` int32,
        ``lens [P, L, B]`` int32, ``self_rows [L, B]`` bool."""
        kv, pools = self.kv, [self.kv.pools[p] for p in self.precisions]
        queries = []

        def attention(layer, q, k, v):
            if self.record_queries:
                queries.append(q)
            for i, pool in enumerate(pools):
                kv_store.store_slots(pool.k, pool.v, pool.k_scale, pool.v_scale, slots[i, layer], k, v, pool.bits)
            if self.fused:   # one opaque call to the fused C kernel
                return torch.ops.structkv.paged_decode_attention_pools(
                    q.contiguous(), [p.k for p in pools], [p.v for p in pools], [p.k_scale for p in pools],
                    [p.v_scale for p in pools], [t[layer] for t in tables], [lens[i, layer] for i in range(len(pools))],
                    [p.bits for p in pools], k.contiguous(), v.contiguous(), self_rows[layer],
                    q.shape[-1] ** -0.5).to(q.dtype)
            return attend_pools(q, pools, [t[layer] for t in tables], [lens[i, layer] for i in range(len(pools))],
                                (k, v, self_rows[layer]) if self.with_self else None, static=True)

        logits = self.model.logits(self.model(ids, positions, attention))
        return (logits, torch.stack(queries)) if self.record_queries else logits

    def _inputs(self, ids: torch.Tensor, positions: torch.Tensor, plan: DecodePlan):
        """The graph's inputs for ``plan``, the batch padded to ``n`` rows (padding rows: no
        context, their writes to each pool's trash slot)."""
        b = ids.shape[0]
        n = next(x for x in self.buckets if x >= b) if self.cuda else max(b, 2)
        L, dev = self.kv.cfg.num_layers, self.device

        def pad(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
            if x.shape[dim] == size:
                return x
            shape = list(x.shape)
            shape[dim] = size - x.shape[dim]
            return torch.cat([x, x.new_zeros(shape)], dim)

        slots = torch.stack([pad(plan.slot_mapping[p], 1, n) if p in plan.slot_mapping
                             else torch.zeros(L, n, dtype=torch.int64, device=dev) for p in self.precisions])
        tables, lens = [], []
        for p in self.precisions:
            if p in plan.block_tables:
                t = pad(plan.block_tables[p], 1, n)
                width = self.max_pages if self.cuda else max(t.shape[2], 2)
                tables.append(pad(t, 2, width))
                lens.append(pad(plan.context_lens[p], 1, n))
            else:
                tables.append(torch.zeros(L, n, self.max_pages if self.cuda else 2, dtype=torch.int32, device=dev))
                lens.append(torch.zeros(L, n, dtype=torch.int32, device=dev))
        self_rows = (pad(plan.self_rows, 1, n) if plan.self_rows is not None
                     else torch.zeros(L, n, dtype=torch.bool, device=dev))
        return pad(ids, 0, n), pad(positions, 0, n), slots, tuple(tables), torch.stack(lens), self_rows

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, plan: DecodePlan):
        """``(logits [B, vocab] float32, queries)`` of the decode step over ``plan`` (its KV
        stored as the eager forward stores it; ``queries``: layer -> ``[B, Hq, D]`` with
        ``record_queries``, else empty), or None when the graph failed (the caller runs eager;
        the failure is logged once and the graph is not tried again)."""
        b = ids.shape[0]
        try:
            # No duck sizing: sizes equal at the first call (the batch and the pool count, say)
            # must not become one symbol, or a later step recompiles.
            # CPU: inductor's freezing makes the weights constants, which it prepacks for oneDNN
            # as the eager model does (replicas.models.llama.PackedLinear): a step at batch 8 x
            # 512 tokens 7.97 -> 5.34 ms on the embedded model (bench.step_profile --graph). A
            # patch, not torch.compile's ``options``: TorchDynamo reads it when it traces.
            with torch.fx.experimental._config.patch(use_duck_shape=False), \
                    torch._inductor.config.patch(freezing=not self.cuda):
                out = self._compiled(*self._inputs(ids, positions, plan))
        except Exception:   # compile or capture failure: eager from now on (the eager forward
            # writes the same values at the same slots, so a partial run changes nothing)
            logger.exception("the compiled decode graph failed; decoding eagerly from now on")
            self.failed = True
            return None
        self.calls += 1
        logits, stacked = out if self.record_queries else (out, None)
        logits = logits[:b].float()
        queries = {} if stacked is None else dict(enumerate(stacked[:, :b].clone().unbind(0)))
        # (a CUDA graph's outputs are overwritten by its next replay)
        return (logits.clone() if self.cuda else logits), queries
