"""Tensor parallelism: attention heads and MLP columns split across ranks (Megatron layout),
applied to the unchanged model as a function (gpt-fast's ``apply_tp``), all-reduce through
``torch.distributed`` (gloo on CPU, nccl on CUDA). The KV cache of each rank holds its KV heads.

Rank 0 runs the engine; ranks 1..N-1 are workers that mirror every model-runner call and every
KV cache mutation, which rank 0 broadcasts before running it itself. All ranks compute the same
logits (the LM head is replicated), so only rank 0 samples. Workers are Ray tasks on bundles
1..N-1 of the caller's placement group when it runs inside one with a bundle per rank (a Ray Serve
replica deployed with ``placement_group_bundles``, as Ray Serve LLM does), else local processes.
"""

from __future__ import annotations

import socket
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from replicas.models import CausalLM
from replicas.spawn import start_without_main


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


def shard_model(model: CausalLM, rank: int, world_size: int) -> CausalLM:
    """Keep this rank's slice of every attention and MLP weight, in place.

    q / k / v projections and MLP gate / up keep rows (output features) of this rank's heads /
    columns; o_proj and down_proj keep the matching input columns and all-reduce their output.

    Raises:
        ValueError: KV heads or the MLP width not divisible by ``world_size``.
    """
    cfg = model.config
    if cfg.num_kv_heads % world_size or cfg.intermediate_size % world_size:
        raise ValueError(f"tensor_parallel_size {world_size} must divide num_kv_heads ({cfg.num_kv_heads}) "
                         f"and intermediate_size ({cfg.intermediate_size})")
    if world_size == 1:
        return model

    def rows(linear, n):
        part = linear.weight.shape[0] // n
        linear.weight = torch.nn.Parameter(linear.weight[rank * part:(rank + 1) * part].clone(), requires_grad=False)
        if linear.bias is not None:
            linear.bias = torch.nn.Parameter(linear.bias[rank * part:(rank + 1) * part].clone(), requires_grad=False)

    def cols(linear, n):
        part = linear.weight.shape[1] // n
        linear.weight = torch.nn.Parameter(linear.weight[:, rank * part:(rank + 1) * part].clone(), requires_grad=False)

    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            rows(lin, world_size)
        cols(attn.o_proj, world_size)
        cols(mlp.down_proj, world_size)
        attn.reduce = mlp.reduce = _all_reduce
    return model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(rank: int, world_size: int, port: int, device: torch.device, addr: str = "127.0.0.1") -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world_size)


class Broadcaster:
    """Rank 0's side: sends calls to the workers, which replay them on their shard.

    KV-cache mutations are *deferred* and go out with the next forward (prefill or decode) in one
    ``broadcast_object_list``: the workers' caches only need to agree with rank 0's when a forward
    reads them, so a step costs one collective however many sequences it admits, frees, plans,
    releases or demotes (PASK's budget demotions were one collective per ``set_precision``)."""

    def __init__(self):
        self.pending: list[tuple[str, tuple]] = []
        self.num_sent = 0      # collectives so far (tests count them)

    def defer(self, method: str, *args: Any) -> None:
        self.pending.append((method, args))

    def send(self, method: str, *args: Any) -> None:
        """Broadcast the deferred calls and then ``method(*args)``, in order, as one message."""
        calls, self.pending = self.pending + [(method, args)], []
        dist.broadcast_object_list([("calls", calls)], src=0)
        self.num_sent += 1


class MirroredKVCache:
    """Rank 0's KV cache: mutations are applied locally at once and replayed on the workers with
    the next forward (:class:`Broadcaster`)."""

    MUTATIONS = ("add_sequence", "free_sequence", "set_precision", "plan_decode", "release_one", "truncate")

    def __init__(self, local, broadcaster: Broadcaster):
        self._local, self._bcast = local, broadcaster

    def __getattr__(self, name):
        attr = getattr(self._local, name)
        if name in self.MUTATIONS:
            def mirrored(*args):
                result = attr(*args)      # a call that raises changed nothing: not replayed
                self._bcast.defer("kv." + name, *args)
                return result
            return mirrored
        return attr


class MirroredRunner:
    """Rank 0's model runner: a forward is broadcast (with the deferred KV mutations), then run
    locally. The decode plan itself was built on every rank by the mirrored ``kv.plan_decode``."""

    def __init__(self, local, broadcaster: Broadcaster):
        self._local, self._bcast = local, broadcaster

    def forward(self, seqs, plan, chunks, record_queries: bool = False, observation_window: int = 0,
                keep_hidden: int = 0):
        last = [s.output_token_ids[-1] if s.output_token_ids else s.prompt_token_ids[-1] for s in seqs]
        self._bcast.send("forward", [(s.request_id, t, s.num_tokens) for s, t in zip(seqs, last)], chunks)
        return self._local.forward(seqs, plan, chunks, record_queries, observation_window, keep_hidden)

    def prefill(self, chunks, observation_window: int = 0, keep_hidden: int = 0):
        return self.forward([], None, chunks, False, observation_window, keep_hidden)[2]

    def decode(self, seqs, plan, record_queries: bool = False):
        logits, queries, _ = self.forward(seqs, plan, [], record_queries)
        return logits, queries

    def window_ppl(self, hidden, token_ids):
        return self._local.window_ppl(hidden, token_ids)


class _Stub:
    """What a worker's runner reads of a decoding sequence: its id, its last token and its
    length (prompt chunks travel as the ``PrefillChunk`` s themselves)."""

    def __init__(self, request_id, token_ids, num_tokens=None):
        self.request_id, self.all_token_ids = request_id, token_ids
        self.prompt_token_ids, self.output_token_ids = token_ids, []
        self.num_tokens = len(token_ids) if num_tokens is None else num_tokens


def worker_main(rank: int, world_size: int, port: int, config, addr: str = "127.0.0.1",
                device_index: int | None = None) -> None:
    """A worker rank: build the shard, then replay rank 0's calls until told to stop."""
    from replicas.engine import build_rank
    torch.set_num_threads(max(1, torch.get_num_threads() // world_size))
    runner, kv = build_rank(config, rank, world_size, port, addr, device_index)
    plan = None
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        method, args = box[0]
        if method == "stop":
            break
        for method, args in args:          # "calls": deferred KV mutations, then a forward
            if method.startswith("kv."):
                result = getattr(kv, method[3:])(*args)
                if method == "kv.plan_decode":
                    plan = result          # the step's plan, read by the "decode" that follows
            elif method == "forward":
                seqs = [_Stub(rid, [tok], n) for rid, tok, n in args[0]]
                runner.forward(seqs, plan if seqs else None, args[1])
    dist.destroy_process_group()


def current_placement_group(world_size: int):
    """The Ray placement group this process runs in, when it has a bundle for every rank."""
    try:
        import ray
        from ray.util import get_current_placement_group
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    pg = get_current_placement_group()
    return pg if pg is not None and len(pg.bundle_specs) >= world_size else None


class _RayWorker:
    """A worker rank running as a Ray task on one bundle of the replica's placement group."""

    def __init__(self, pg, rank: int, world_size: int, port: int, config, addr: str):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        bundle = pg.bundle_specs[rank]
        gpus = bundle.get("GPU", 0)
        task = ray.remote(worker_main).options(
            num_cpus=bundle.get("CPU", 0), num_gpus=gpus, max_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank))
        # Ray shows each task only its own GPU, as device 0.
        self.ref = task.remote(rank, world_size, port, config, addr, 0 if gpus else None)

    def join(self, timeout: float) -> None:
        import ray
        ray.wait([self.ref], timeout=timeout)


def start_workers(world_size: int, port: int, config) -> tuple[list, str]:
    """Start ranks 1..N-1; returns (handles with ``join(timeout)``, rendezvous address)."""
    pg = current_placement_group(world_size)
    if pg is not None:
        import ray
        addr = ray.util.get_node_ip_address()
        return [_RayWorker(pg, r, world_size, port, config, addr) for r in range(1, world_size)], addr
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker_main, args=(r, world_size, port, config), daemon=True)
             for r in range(1, world_size)]
    for p in procs:
        start_without_main(p)
    return procs, "127.0.0.1"
