"""Paged, mixed-precision, compressible KV cache: device pools + host block manager + step plan.

Every (sequence, layer, token) entry is kept at HIGH precision (the model dtype), kept quantized
(INT8, or INT4 packed two per byte; one float32 scale per token and KV head) or released. Each
precision has its own page pool, allocated once when the engine starts and never grown; a page
holds ``block_size`` slots of one (sequence, layer). Where each entry lives is the business of
:class:`replicas.block_manager.BlockManager` (host accounting only).

Keys are stored after RoPE, and each entry records its token's true position, so releasing tokens
never shifts the positions of later ones.

Byte accounting is exact: a page costs its K and V data, its scales (quantized pools) and its
int32 position column (held by the block manager); each page also costs one int32 block-table entry.

A decode step is one :class:`DecodePlan` (:meth:`KVCache.plan_decode`): the pool-flat slot of
every new token in every layer, at the precision its policy chose when the token was sampled (the
*slot mapping*; no write-then-demote), and per pool the block tables and context lengths of the
batch. The model's attention reads only the plan: :meth:`KVCache.store` and
:meth:`KVCache.attend` run once per layer with no Python over sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

import kernels
from kernels import kv_store
from replicas.block_manager import BlockManager, KVCacheOutOfMemory, TRASH_PAGE
from replicas.precision import BITS, Precision
from replicas.prefix_cache import PrefixCache, shadow_id

BLOCK_TABLE_ENTRY_BYTES = 4
ALL_PRECISIONS = (Precision.HIGH, Precision.INT8, Precision.INT4)

__all__ = ["BITS", "BLOCK_TABLE_ENTRY_BYTES", "DecodePlan", "KVCache", "KVCacheConfig", "KVCacheOutOfMemory",
           "Precision", "page_bytes"]


@dataclass(frozen=True)
class KVCacheConfig:
    """Shape and budget of the KV cache of one engine (one tensor-parallel rank).

    Attributes:
        num_layers: decoder layers.
        num_kv_heads: KV heads held by this rank.
        head_dim: per-head dimension (even, for INT4).
        dtype: HIGH precision dtype (the model dtype).
        block_size: token slots per page.
        max_bytes: pool budget in bytes, over all precisions (pages + block-table entries).
        device: where the pools live.
        max_num_seqs: sequences the cache holds at once (rows of the block tables).
        max_model_len: positions per sequence (length of the position map).
        precisions: pools to allocate (each with room for ``max_bytes`` of its pages; on the CPU
            memory is committed only where pages are written). A policy that keeps everything at
            HIGH needs only the HIGH pool.
    """
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    block_size: int = 16
    max_bytes: int = 1 << 30
    device: str = "cpu"
    max_num_seqs: int = 64
    max_model_len: int = 4096
    precisions: tuple[Precision, ...] = ALL_PRECISIONS

    def __post_init__(self):
        if min(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.max_num_seqs,
               self.max_model_len) < 1:
            raise ValueError(f"KV cache dimensions must be positive: {self}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (INT4 packs pairs), got {self.head_dim}")
        if self.max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {self.max_bytes}")
        if Precision.HIGH not in self.precisions or not set(self.precisions) <= set(ALL_PRECISIONS):
            raise ValueError(f"precisions must include HIGH and name only HIGH / INT8 / INT4: {self.precisions}")


def page_bytes(cfg: KVCacheConfig, precision: Precision) -> int:
    """Bytes of one page of ``precision``: K and V data, scales, the position column."""
    h, d, bs, bits = cfg.num_kv_heads, cfg.head_dim, cfg.block_size, BITS[precision]
    elem = torch.empty((), dtype=cfg.dtype).element_size() if bits == 0 else 1
    data_dim = d // 2 if bits == 4 else d
    return bs * (2 * h * data_dim * elem + (2 * h * 4 if bits else 0) + 4)


def attend_pools(q: torch.Tensor, pools: list, tables: list, lens: list, new_kv: tuple | None = None,
                 sm_scale: float | None = None, static: bool = False) -> torch.Tensor:
    """Decode attention of ``q [B, Hq, D]`` over paged pools, merged exactly by log-sum-exp
    (one call per pool, no per-row or per-layer Python).

    ``pools[i]`` is a pool (``k, v, k_scale, v_scale, bits``) read through ``tables[i] [B, W]``
    int32 page ids with ``lens[i] [B]`` int32 context lengths. ``new_kv = (k, v, rows)`` adds the
    step's own tokens ``k, v [B, Hkv, D]`` at full precision for the rows where ``rows [B]`` bool
    is set (tokens stored below HIGH, or not stored). ``static``: the fixed-shape kernel path a
    compiled or captured graph needs. Returns ``[B, Hq, D]`` in q's dtype. The eager
    :meth:`KVCache.attend` and the compiled decode graph both call this.
    """
    n = len(pools) + (new_kv is not None)
    outs, lses = [], []
    for pool, table, ln in zip(pools, tables, lens):
        out, lse = kernels.paged_decode_attention(q, pool.k, pool.v, pool.k_scale, pool.v_scale, table, ln,
                                                  pool.bits, sm_scale, need_lse=n > 1, static=static)
        outs.append(out)
        lses.append(lse)
    if new_kv is not None:   # one key each: the output is the value, the log-sum-exp the scaled score
        k, v, rows = new_kv
        g = q.shape[1] // k.shape[1]
        kr, vr = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
        scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        outs.append(vr)
        lses.append(((q.float() * kr).sum(-1) * scale).masked_fill(~rows[:, None], float("-inf")))
    merged = outs[0] if len(outs) == 1 else kernels.merge_attention_states(outs, lses)
    return merged.to(q.dtype)


class _Pool:
    """Device tensors of one precision, ``[pages, block_size, Hkv, Dk]``, allocated once."""

    def __init__(self, cfg: KVCacheConfig, precision: Precision, num_pages: int):
        self.precision, self.bits = precision, BITS[precision]
        h, d, bs = cfg.num_kv_heads, cfg.head_dim, cfg.block_size
        self.data_dtype = cfg.dtype if self.bits == 0 else (torch.int8 if self.bits == 8 else torch.uint8)
        data_dim = d // 2 if self.bits == 4 else d
        shape = (num_pages, bs, h, data_dim)
        # torch.empty: on the CPU the kernel hands out zero pages lazily, so an unused pool costs
        # no memory; pages are zeroed when first handed out (KVCache._zero_fresh).
        alloc = torch.empty if torch.device(cfg.device).type == "cpu" else torch.zeros
        self.k = alloc(shape, dtype=self.data_dtype, device=cfg.device)
        self.v = alloc(shape, dtype=self.data_dtype, device=cfg.device)
        self.k_scale = alloc(shape[:3], dtype=torch.float32, device=cfg.device) if self.bits else None
        self.v_scale = alloc(shape[:3], dtype=torch.float32, device=cfg.device) if self.bits else None
        self.fresh_from = 0 if alloc is torch.empty else num_pages   # pages >= this never written
        # Views ``[pages * block_size, ...]`` indexed by pool-flat slot, made once (the pools are
        # never reallocated), so that moving entries makes no view per call.
        flat = lambda t: None if t is None else t.view(-1, *t.shape[2:])
        self.k_flat, self.v_flat = flat(self.k), flat(self.v)
        self.k_scale_flat, self.v_scale_flat = flat(self.k_scale), flat(self.v_scale)
        self.flat_tensors = [t for t in (self.k_flat, self.v_flat, self.k_scale_flat, self.v_scale_flat)
                             if t is not None]
        # On the host, NumPy views of the same memory for the step's moves (fancy indexing at a
        # third of PyTorch's cost per call); None where NumPy lacks the dtype (bfloat16).
        try:
            self.flat_arrays = [t.numpy() for t in self.flat_tensors] if self.k.device.type == "cpu" else None
        except TypeError:
            self.flat_arrays = None

    def tensors(self):
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]


@dataclass
class DecodePlan:
    """Everything a decode step's forward reads (built by :meth:`KVCache.plan_decode`).

    Attributes:
        rows: ``[B]`` int64 block-manager rows of the batch, in batch order.
        slot_mapping: precision -> ``[L, B]`` int64 pool-flat slot of each new token (the trash
            slot where the token goes to another pool or is not stored).
        block_tables: precision -> ``[L, B, max_pages]`` int32 page ids (device).
        context_lens: precision -> ``[L, B]`` int32 entries each sequence attends in that pool
            (device): the new token included where it is stored at HIGH, excluded elsewhere.
        active: precision -> per layer, whether any sequence attends entries in that pool.
        self_rows: ``[L, B]`` bool, rows whose new token is not kept at HIGH in a layer: the token
            attends to its own key and value at full precision (they are in hand), as it would
            have before being demoted, and is stored quantized (or not at all) for later steps.
        any_self: per layer, whether any row is in ``self_rows``.
        positions: ``[B]`` int64 (host) position of each row's new token.
        capturable: attend with the graph-capturable kernel where the reference runs (no value read
            back to the host; ``torch.compile(fullgraph=True)`` / CUDA graphs).
    """
    rows: torch.Tensor
    slot_mapping: dict[Precision, torch.Tensor]
    block_tables: dict[Precision, torch.Tensor] = field(default_factory=dict)
    context_lens: dict[Precision, torch.Tensor] = field(default_factory=dict)
    active: dict[Precision, list[bool]] = field(default_factory=dict)
    self_rows: torch.Tensor | None = None
    any_self: list[bool] | None = None
    positions: torch.Tensor | None = None
    capturable: bool = False


class KVCache:
    """The KV store of one engine rank: device pools and the host block manager."""

    def __init__(self, cfg: KVCacheConfig):
        self.cfg = cfg
        self._page_cost = {p: page_bytes(cfg, p) + BLOCK_TABLE_ENTRY_BYTES for p in BITS}
        caps = {p: (cfg.max_bytes // self._page_cost[p] + 1 if p in cfg.precisions else 1) for p in BITS}
        self.pools = {p: _Pool(cfg, p, caps[p]) for p in BITS}
        self.blocks = BlockManager(cfg.num_layers, cfg.block_size, cfg.max_num_seqs, cfg.max_model_len,
                                   self._page_cost, caps, cfg.max_bytes)
        self.device = torch.device(cfg.device)
        self._off_host = self.device.type != "cpu"   # index tensors built on the host move there
        self._triton_store = kernels.use_triton(self.device)   # (STRUCTKV_KERNELS read once, here)
        self.prefix = None   # replicas.prefix_cache.PrefixCache, when enabled

    def enable_prefix_cache(self, key, shadow: bool = False, keep: int = 1) -> None:
        """Share prompt-prefix KV between sequences (``replicas.prefix_cache``); ``key`` names the
        model, policy and tables (a new key invalidates every entry). ``shadow``: the policy
        compresses its prompt, so each prompt in progress has a full-precision shadow row that
        shares the cached pages and that its chunks attend to; the sequence's own row gets the
        prefix copied at its targets. ``keep``: tokens at a prompt's end never taken from the
        cache (the policy's observation window is computed)."""
        if self.prefix is None:
            self.prefix = PrefixCache(self.blocks, key, shadow, keep)
        else:
            self.prefix.set_key(key)
            self.prefix.shadow, self.prefix.keep = shadow, max(1, keep)

    def prefix_hit(self, token_ids: list[int]) -> tuple[int, int]:
        """``(tokens of token_ids cached, bytes of those cached pages now evictable)``."""
        return (0, 0) if self.prefix is None else self.prefix.peek(token_ids, self.prefix.keep)

    def attach_prefix(self, seq_id, token_ids: list[int]) -> int:
        """Give the new ``seq_id`` the cached prefix of ``token_ids`` (in shadow mode: give it a
        shadow row that holds it); returns its tokens (0 without a cache)."""
        if self.prefix is None:
            return 0
        if not self.prefix.shadow:
            return self.prefix.attach(seq_id, token_ids, self.prefix.keep)
        self.blocks.add(shadow_id(seq_id))
        return self.prefix.attach(shadow_id(seq_id), token_ids, self.prefix.keep)

    def shadow_of(self, seq_id):
        """The row id of ``seq_id``'s full-precision shadow while its prompt is prefilled, or None."""
        if self.prefix is None or not self.prefix.shadow:
            return None
        sid = shadow_id(seq_id)
        return sid if sid in self.blocks.rows else None

    def copy_prefix(self, seq_id, num_tokens: int, targets: torch.Tensor | None) -> None:
        """Store positions ``0 .. num_tokens - 1`` of ``seq_id``'s shadow (a cache hit) in its own
        row, at ``targets [>= num_tokens, L]`` Precision values per layer (None: HIGH): what a
        prefill of those tokens would have stored, from the same full-precision KV.

        Raises:
            KVCacheOutOfMemory: the copy does not fit (the row may hold part of it).
        """
        sid, pos = self.shadow_of(seq_id), torch.arange(num_tokens)
        key = None
        if targets is not None:   # stored at targets known now (PASK): the compressed form is shared
            key = self.prefix.snapshot_key(sid, num_tokens, targets)
            moves = self.prefix.attach_snapshot(seq_id, key)
            if moves is not None:
                self._copy_moves(moves)
                return
        for layer in range(self.cfg.num_layers):
            _, k, v = self.gather(sid, layer)
            self.append(seq_id, layer, pos, k[:num_tokens], v[:num_tokens],
                        Precision.HIGH if targets is None else targets[:num_tokens, layer])
        if key is not None:
            self._copy_moves(self.prefix.register_snapshot(seq_id, key, num_tokens))

    def _copy_moves(self, moves: dict) -> None:
        for p, (dst, src) in moves.items():
            self._zero_fresh(p)
            self._move(p, dst, src)

    def _unshare(self, row: int, layer: int, p: Precision, slots: torch.Tensor) -> None:
        """Copy-on-write before ``slots`` of (row, layer, p) change: if any lies in a shared
        compressed-prefix page, the row gets its own copies of those pages."""
        b = self.blocks
        if slots.numel() and int(b.snap_pages[p][row, layer]) and \
                bool((slots < b.snap_pages[p][row, layer] * b.block_size).any()):
            self._copy_moves({p: b.unshare(row, layer, p)})

    def cache_prefix(self, seq_id, token_ids: list[int], num_computed: int) -> None:
        """Cache ``seq_id``'s (or its shadow's) full pages of ``token_ids[:num_computed]`` (no-op
        without a cache)."""
        if self.prefix is not None:
            self.prefix.register(self.shadow_of(seq_id) or seq_id, token_ids, num_computed)

    def drop_shadow(self, seq_id) -> None:
        """Free ``seq_id``'s shadow (its prompt is in the cache; its cached pages stay cached)."""
        sid = self.shadow_of(seq_id)
        if sid is not None:
            self.prefix.release(sid)
            self.blocks.free(sid)

    # ------------------------------------------------------------------ accounting
    @property
    def seqs(self) -> dict:
        """Sequence id -> block-manager row of every sequence with a cache."""
        return self.blocks.rows

    @property
    def bytes_used(self) -> int:
        return self.blocks.bytes_used

    @property
    def bytes_free(self) -> int:
        """Free bytes, counting cached prefix pages no sequence references (evicted on demand)."""
        return self.blocks.bytes_free + (self.prefix.idle_bytes if self.prefix is not None else 0)

    def page_cost(self, precision: Precision) -> int:
        return self._page_cost[precision]

    def row(self, seq_id) -> int:
        return self.blocks.rows[seq_id]

    def sequence_bytes(self, seq_id) -> int:
        """Bytes held by one sequence: its pages and their block-table entries."""
        return int(self.blocks.row_bytes[self.blocks.rows[seq_id]])

    def shared_tokens(self, seq_id) -> int:
        """Positions ``0 .. n - 1`` of a sequence held in shared (read-only) prefix pages: ``n``."""
        return int(self.blocks.shared_pages[self.blocks.rows[seq_id]]) * self.cfg.block_size

    def next_token_bytes(self, seq_id) -> int:
        """Bytes the next decode token of a sequence may need (see ``BlockManager.next_token_bytes``)."""
        return self.blocks.next_token_bytes([self.blocks.rows[seq_id]])

    def next_step_bytes(self, seq_ids) -> int:
        """:meth:`next_token_bytes` summed over ``seq_ids``, in one pass."""
        return self.blocks.next_token_bytes([self.blocks.rows[s] for s in seq_ids])

    def full_kv_bytes(self, num_tokens: int) -> int:
        """Bytes that full KV (HIGH, all layers) would hold for ``num_tokens`` tokens."""
        return self.cfg.num_layers * math.ceil(num_tokens / self.cfg.block_size) * self._page_cost[Precision.HIGH]

    def full_kv_bytes_batch(self, num_tokens: list[int]) -> np.ndarray:
        """:meth:`full_kv_bytes` of each count, in one array op: ``[n]`` int64."""
        bs = self.cfg.block_size
        pages = (np.asarray(num_tokens, dtype=np.int64) + (bs - 1)) // bs
        return pages * (self.cfg.num_layers * self._page_cost[Precision.HIGH])

    def num_kept(self, seq_id, layer: int, precision: Precision | None = None) -> int:
        row = self.blocks.rows[seq_id]
        if precision is not None:
            return int(self.blocks.num_slots[precision][row, layer])
        return sum(int(self.blocks.num_slots[p][row, layer]) for p in BITS)

    def kept_positions(self, seq_id, layer: int) -> torch.Tensor:
        """``[n]`` int64 positions kept in (sequence, layer), ascending."""
        b = self.blocks
        row = b.rows[seq_id]
        top = int(b.next_position[row, layer])
        return (b.location[row, layer, :top] >= 0).nonzero().flatten()

    def kept_mask(self, seq_id, num_positions: int) -> torch.Tensor:
        """``[L, num_positions]`` bool: whether each layer keeps each of positions ``0 .. n - 1``."""
        b = self.blocks
        return b.location[b.rows[seq_id], :, :num_positions] >= 0

    def precisions_at(self, seq_id, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """``[n]`` int64 Precision value of each of ``positions [n]`` in (sequence, layer)
        (RELEASED = 0 where not kept)."""
        b = self.blocks
        loc = b.location[b.rows[seq_id], layer, positions.long()]
        return torch.where(loc >= 0, loc & 3, 0).long()

    def kept(self, seq_id, layer: int) -> dict[int, Precision]:
        """Position -> precision of every entry kept for (sequence, layer)."""
        b = self.blocks
        row = b.rows[seq_id]
        loc = b.location[row, layer, :int(b.next_position[row, layer])]
        pos = (loc >= 0).nonzero().flatten()
        return {p: Precision(c) for p, c in zip(pos.tolist(), (loc[pos] & 3).tolist())}

    # ------------------------------------------------------------------ sequences
    def add_sequence(self, seq_id) -> None:
        """Raises ValueError: the sequence already has a cache, or ``max_num_seqs`` are held."""
        self.blocks.add(seq_id)

    def free_sequence(self, seq_id) -> None:
        if self.prefix is not None:
            self.drop_shadow(seq_id)
            self.prefix.release(seq_id)
        self.blocks.free(seq_id)

    def _zero_fresh(self, precision: Precision) -> None:
        """Zero pages handed out for the first time (a never-written page may hold NaN bits, and
        attention reads whole pages: masked slots must be finite)."""
        pool = self.pools[precision]
        free = self.blocks.free_pages[precision]
        top = pool.k.shape[0] - len(free)  # pages ever handed out, trash included, at most
        # (shape[0], not len(): a tensor's __len__ is five Python calls)
        if top > pool.fresh_from:
            for t in pool.tensors():
                t[pool.fresh_from:top] = 0
            pool.fresh_from = top

    # ------------------------------------------------------------------ writes
    def _write(self, precision: Precision, flat: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        pool = self.pools[precision]
        if self._off_host:
            flat = flat.to(self.device)
        if pool.bits == 0:
            pool.k_flat[flat] = k.to(pool.data_dtype)
            pool.v_flat[flat] = v.to(pool.data_dtype)
        elif self._triton_store:
            kernels.quantize_store(k, pool.k_flat, pool.k_scale_flat, flat, pool.bits)
            kernels.quantize_store(v, pool.v_flat, pool.v_scale_flat, flat, pool.bits)
        else:   # the reference: keys and values quantized in one call (scales are per row)
            n = k.shape[0]
            data, scale = kernels.quantize_ref(torch.cat([k, v]), pool.bits)
            pool.k_flat[flat], pool.v_flat[flat] = data[:n], data[n:]
            pool.k_scale_flat[flat], pool.v_scale_flat[flat] = scale[:n], scale[n:]

    def _read(self, precision: Precision, flat: torch.Tensor):
        pool = self.pools[precision]
        if self._off_host:
            flat = flat.to(self.device)
        if pool.bits == 0:
            return pool.k_flat[flat], pool.v_flat[flat]
        return (kernels.dequantize_ref(pool.k_flat[flat], pool.k_scale_flat[flat], pool.bits, self.cfg.dtype),
                kernels.dequantize_ref(pool.v_flat[flat], pool.v_scale_flat[flat], pool.bits, self.cfg.dtype))

    def _move(self, precision: Precision, dst, src) -> None:
        """``pool[dst] = pool[src]`` for the pool-flat slots ``dst, src`` (``[n]`` int64, tensors
        or NumPy arrays)."""
        if dst.shape[0]:   # (not len(): a tensor's __len__ is five Python calls)
            pool = self.pools[precision]
            if isinstance(dst, np.ndarray):
                if pool.flat_arrays is not None:
                    for f in pool.flat_arrays:
                        f[dst] = f[src]
                    return
                dst, src = torch.from_numpy(dst), torch.from_numpy(src)
            if self._off_host:
                dst, src = dst.to(self.device), src.to(self.device)
            for f in pool.flat_tensors:
                f[dst] = f[src]

    def append(self, seq_id, layer: int, positions, k: torch.Tensor, v: torch.Tensor,
               precision: Precision = Precision.HIGH) -> None:
        """Store new tokens of one (sequence, layer).

        Args:
            positions: ``[n]`` true token positions (ints), none of them already stored here.
            k, v: ``[n, Hkv, D]``, keys after RoPE.
            precision: HIGH, INT8, INT4, or RELEASED (nothing stored; the positions are used up),
                or an ``[n]`` tensor of Precision values, one per token.

        Raises:
            KVCacheOutOfMemory: the pool budget cannot hold the new pages (nothing is written).
            ValueError: positions not above every position stored before in this layer
                (or repeated), or a shape mismatch.
        """
        pos = torch.as_tensor(list(positions) if not isinstance(positions, torch.Tensor) else positions,
                              dtype=torch.int64).flatten()
        n = pos.shape[0]
        if k.shape != v.shape or k.shape != (n, self.cfg.num_kv_heads, self.cfg.head_dim):
            raise ValueError(f"k, v must be [{n}, {self.cfg.num_kv_heads}, "
                             f"{self.cfg.head_dim}], got {tuple(k.shape)}, {tuple(v.shape)}")
        b = self.blocks
        row = b.rows[seq_id]
        if not n:
            return
        low = int(b.next_position[row, layer])
        if int(pos.min()) < low or pos.unique().numel() != n:
            raise ValueError(f"sequence {seq_id!r}, layer {layer}: positions must be new and at least "
                             f"{low}, got {pos.tolist()[:8]}")
        if int(pos.max()) >= b.max_model_len:
            raise ValueError(f"sequence {seq_id!r}: position {int(pos.max())} past max_model_len {b.max_model_len}")
        if isinstance(precision, torch.Tensor):   # one precision per token
            prec = precision.to(torch.int64).flatten()
            need = {p: int((prec == int(p)).sum()) for p in BITS}
            cost = sum(max(0, -(-(int(b.num_slots[p][row, layer]) + m) // self.cfg.block_size)
                           - int(b.num_pages[p][row, layer])) * self._page_cost[p] for p, m in need.items() if m)
            b.check_fits(cost, f"layer {layer}'s new pages")
            for p in BITS:
                if need[p]:
                    m = prec == int(p)
                    flat = b.append(row, layer, p, pos[m])
                    self._zero_fresh(p)
                    self._write(p, flat, k[m.to(k.device)], v[m.to(v.device)])
        elif precision != Precision.RELEASED:
            precision = Precision(precision)
            flat = b.append(row, layer, precision, pos)
            self._zero_fresh(precision)
            self._write(precision, flat, k, v)
        b.next_position[row, layer] = int(pos.max()) + 1

    def set_precision(self, seq_id, layers, positions, precision: Precision) -> int:
        """Demote kept tokens to ``precision`` (INT8, INT4) or release them (RELEASED), in one
        layer or in several at once.

        Args:
            layers: a layer (int) or several (a range or sequence of ints): the same ``positions``
                change in each.
            positions: distinct token positions (ints or an int64 tensor); those not kept, or kept
                at or below ``precision`` in a layer, are left as they are there (precision never
                rises: dropped bits and released tokens never come back).

        Every entry moves in one batched swap-remove per source pool and one store into the target
        pool, whatever the number of layers (PASK's demotions change a whole layer group). The
        entries leave their pools before the target's pages are taken, so a demotion never holds
        more pages than it ends with. Returns bytes freed (negative when demoting fills new LOW
        pages).

        Raises:
            KVCacheOutOfMemory: the target pool cannot hold the entries once they have left their
                pools (nothing changes).
        """
        precision = Precision(precision)
        b = self.blocks
        row = b.rows[seq_id]
        layer_ids = torch.tensor([layers] if isinstance(layers, int) else list(layers), dtype=torch.int64)
        pos = torch.as_tensor(positions if isinstance(positions, torch.Tensor) else list(positions),
                              dtype=torch.int64).flatten()
        pos = pos[(pos >= 0) & (pos < b.max_model_len)]
        loc = b.location[row][layer_ids[:, None], pos[None, :]]                  # [layers, n]
        sel = (loc >= 0) & ((loc & 3) > int(precision))
        if not bool(sel.any()):
            return 0
        li, pi = sel.nonzero(as_tuple=True)                                      # layer-major
        lay, pos, loc = layer_ids[li], pos[pi], loc[li, pi]
        src = loc & 3
        held = src.bincount(minlength=len(BITS) + 1).tolist()                   # entries per source pool
        sources = [p for p in BITS if held[int(p)]]
        if b.has_snapshots:                                                      # copy-on-write first
            for p in sources:
                m = src == int(p)
                for layer in torch.unique(lay[m]).tolist():
                    lm = m & (lay == layer)
                    self._unshare(row, layer, p, (loc[lm] >> 2).long())   # (slots stay where they are)
        slot = (loc >> 2).long()
        before = b.bytes_used
        keep = precision != Precision.RELEASED
        if keep:
            b.check_move_fits(row, lay, src, precision)
            h, d = self.cfg.num_kv_heads, self.cfg.head_dim
            k = torch.empty(pos.shape[0], h, d, dtype=self.cfg.dtype, device=self.device)
            v = torch.empty_like(k)
        for p in sources:
            m = src == int(p)
            flat = b.flat_slots(row, lay[m], p, slot[m])
            if keep:
                md = m.to(self.device)
                k[md], v[md] = self._read(p, flat)
            self._move(p, *b.remove(row, layers if isinstance(layers, int) else lay[m], p, slot[m]))
        if keep:
            flat = b.append(row, lay, precision, pos)
            self._zero_fresh(precision)
            self._write(precision, flat, k, v)
        return before - b.bytes_used

    def truncate(self, seq_id, num_tokens: int) -> None:
        """Take back every entry of ``seq_id`` at a position ``>= num_tokens`` in every layer (the
        KV of a jump-forward draft's tokens the model did not sample), so that those positions
        can be stored again: afterwards the sequence holds what it held before they were stored.

        Raises:
            KeyError: an unknown sequence.
            ValueError: ``num_tokens`` below a shared prefix (its pages are read-only).
        """
        b = self.blocks
        row = b.rows[seq_id]
        if num_tokens < self.shared_tokens(seq_id):
            raise ValueError(f"sequence {seq_id!r}: cannot truncate to {num_tokens} tokens inside its "
                             f"shared prefix of {self.shared_tokens(seq_id)}")
        for layer in range(self.cfg.num_layers):
            end = int(b.next_position[row, layer])
            if end > num_tokens:
                self.set_precision(seq_id, layer, range(num_tokens, end), Precision.RELEASED)
        b.next_position[row].clamp_(max=num_tokens)

    def release_one(self, seq_rows: torch.Tensor, layers: torch.Tensor, positions: torch.Tensor) -> None:
        """Release one kept entry per (row, layer) pair, the pairs distinct, in one batched
        swap-remove (what ``set_precision(..., RELEASED)`` does for a single position)."""
        if self.blocks.has_snapshots:   # rows may share a compressed prefix
            b = self.blocks
            loc = b.location[seq_rows, layers, positions]
            for p in BITS:
                hit = (loc >= 0) & ((loc & 3) == int(p))
                hit &= (loc >> 2) < b.snap_pages[p][seq_rows, layers] * b.block_size
                for i in hit.nonzero().flatten().tolist():   # copy-on-write, rare
                    self._unshare(int(seq_rows[i]), int(layers[i]), p, (loc[i:i + 1] >> 2).long())
        for p, (dst, src) in self.blocks.release_one(seq_rows, layers, positions).items():
            self._move(p, dst, src)

    # ------------------------------------------------------------------ the decode step
    def plan_decode(self, seq_ids, positions: torch.Tensor, targets: torch.Tensor | None = None) -> DecodePlan:
        """Place one new token per sequence in every layer and build the step's plan.

        Args:
            seq_ids: the batch, in order; positions: ``[B]`` int64 new positions (each above its
                sequence's last one).
            targets: ``[B, L]`` int64 Precision values of each new token per layer (RELEASED: not
                stored), None for all HIGH.

        Raises:
            KVCacheOutOfMemory: the pages of the step do not fit (nothing changes).
            ValueError: a position not new, or past ``max_model_len``.
        """
        rows = torch.tensor([self.blocks.rows[s] for s in seq_ids], dtype=torch.int64)
        positions = positions.to(torch.int64).cpu()
        mapping = self.blocks.append_batch(rows, positions, targets)
        for p in mapping:
            self._zero_fresh(p)
        plan = DecodePlan(rows, {p: m.to(self.device) for p, m in mapping.items()}, positions=positions)
        if targets is not None and bool((targets != int(Precision.HIGH)).any()):
            self_rows = (targets != int(Precision.HIGH)).t().contiguous()          # [L, B]
            plan.self_rows, plan.any_self = self_rows.to(self.device), self_rows.any(1).tolist()
        self._attention_tables(plan, targets)
        return plan

    def _attention_tables(self, plan: DecodePlan, targets: torch.Tensor | None = None) -> None:
        """Each pool's ``[L, B, width]`` block tables and ``[L, B]`` context lengths of the batch
        (gathered from the block manager's NumPy views: a few small index operations a step)."""
        v, rows = self.blocks.views, plan.rows.numpy()
        t = targets.numpy() if targets is not None else None
        for p in BITS:
            lens = v.num_slots[p][rows]                                   # [B, L]
            if t is not None and p != Precision.HIGH:
                lens = lens - (t == int(p))        # the new token (last slot) attends exactly
            active = np.logical_or.reduce(lens > 0).tolist()
            if not any(active):
                continue
            width = max(1, int(np.maximum.reduce(v.num_pages[p][rows], axis=None)))
            tables = torch.from_numpy(np.ascontiguousarray(v.block_table[p][rows, :, :width].transpose(1, 0, 2)))
            lens = torch.from_numpy(np.ascontiguousarray(lens.T, dtype=np.int32))
            plan.block_tables[p], plan.context_lens[p] = (tables.to(self.device), lens.to(self.device)) \
                if self._off_host else (tables, lens)
            plan.active[p] = active

    def store(self, plan: DecodePlan, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the batch's new ``k, v [B, Hkv, D]`` of ``layer`` at the plan's slots, each pool
        at its precision (one write per pool). A ``capturable`` plan writes with
        :func:`kernels.kv_store.store_slots`, which a compiled or captured graph keeps in place."""
        for p, mapping in plan.slot_mapping.items():
            if not plan.capturable:
                self._write(p, mapping[layer], k, v)
                continue
            pool = self.pools[p]
            kv_store.store_slots(pool.k, pool.v, pool.k_scale, pool.v_scale, mapping[layer], k, v, pool.bits)

    def attend(self, plan: DecodePlan, layer: int, q: torch.Tensor, k: torch.Tensor | None = None,
               v: torch.Tensor | None = None, sm_scale: float | None = None) -> torch.Tensor:
        """Attention of the batch's queries ``q [B, Hq, D]`` over every entry its sequences keep in
        ``layer`` (HIGH, INT8 and INT4 pools merged exactly), the new tokens ``k, v [B, Hkv, D]``
        included at full precision; returns ``[B, Hq, D]`` in q's dtype.

        Raises:
            ValueError: no sequence attends any entry in ``layer``.
        """
        pools = [p for p, active in plan.active.items() if active[layer]]
        with_self = plan.any_self is not None and plan.any_self[layer]
        if not pools and not with_self:
            raise ValueError(f"layer {layer}: no kept KV entries for rows {plan.rows.tolist()}")
        if not plan.capturable and not kernels.use_triton(q.device):
            # The CPU: every pool in one call (the fused C kernel, or one SDPA call of the reference).
            return kernels.paged_decode_attention_pools(
                q, [(self.pools[p].k, self.pools[p].v, self.pools[p].k_scale, self.pools[p].v_scale,
                     plan.block_tables[p][layer], plan.context_lens[p][layer], self.pools[p].bits) for p in pools],
                (k, v, plan.self_rows[layer]) if with_self else None, sm_scale).to(q.dtype)
        return attend_pools(q, [self.pools[p] for p in pools], [plan.block_tables[p][layer] for p in pools],
                            [plan.context_lens[p][layer] for p in pools],
                            (k, v, plan.self_rows[layer]) if with_self else None, sm_scale, static=plan.capturable)

    # ------------------------------------------------------------------ per-layer conveniences
    def append_decode(self, seq_ids: list, layer: int, positions: list[int], k: torch.Tensor,
                      v: torch.Tensor) -> None:
        """Store one new HIGH token per sequence in one layer (tests and tools; the engine's decode
        step uses :meth:`plan_decode` for all layers at once).

        Raises:
            KVCacheOutOfMemory: the pages the batch needs do not fit (nothing is written).
            ValueError: a position not above the sequence's last one in this layer, or a shape mismatch.
        """
        nb = len(seq_ids)
        if k.shape != v.shape or k.shape != (nb, self.cfg.num_kv_heads, self.cfg.head_dim) or len(positions) != nb:
            raise ValueError(f"k, v must be [{nb}, {self.cfg.num_kv_heads}, {self.cfg.head_dim}] with {nb} "
                             f"positions, got {tuple(k.shape)}, {tuple(v.shape)}, {len(positions)}")
        b, bs = self.blocks, self.cfg.block_size
        rows = [b.rows[s] for s in seq_ids]
        for sid, row, pos in zip(seq_ids, rows, positions):
            if pos < int(b.next_position[row, layer]):
                raise ValueError(f"sequence {sid!r}, layer {layer}: positions must be new and at least "
                                 f"{int(b.next_position[row, layer])}, got {pos}")
        need = sum(int(b.num_slots[Precision.HIGH][row, layer]) % bs == 0 for row in rows)
        b.check_fits(need * self._page_cost[Precision.HIGH], f"{need} HIGH pages")
        for i, sid in enumerate(seq_ids):
            self.append(sid, layer, [positions[i]], k[i:i + 1], v[i:i + 1])

    def attention_plan(self, seq_ids) -> DecodePlan:
        """A plan that attends ``seq_ids`` over what they keep, storing nothing."""
        plan = DecodePlan(torch.tensor([self.blocks.rows[s] for s in seq_ids], dtype=torch.int64), {})
        self._attention_tables(plan)
        return plan

    def decode_attention(self, seq_ids: list, layer: int, q: torch.Tensor,
                         sm_scale: float | None = None) -> torch.Tensor:
        """Attention of one query per sequence over its kept entries of ``layer`` (``q [B, Hq, D]``
        for ``seq_ids`` in order); returns ``[B, Hq, D]``."""
        return self.attend(self.attention_plan(seq_ids), layer, q, sm_scale)

    # ------------------------------------------------------------------ reads
    def page_ids(self, seq_id, layer: int, precision: Precision) -> list[int]:
        """Page ids of (sequence, layer, precision), in slot order."""
        b = self.blocks
        row = b.rows[seq_id]
        return b.block_table[precision][row, layer, :int(b.num_pages[precision][row, layer])].tolist()

    def gather(self, seq_id, layer: int):
        """All kept entries of (sequence, layer), dequantized to the model dtype.

        Returns ``(positions [n] int64, k [n, Hkv, D], v [n, Hkv, D])``, HIGH entries first, each
        pool in slot order.
        """
        b = self.blocks
        row = b.rows[seq_id]
        ks, vs, ps = [], [], []
        for p in BITS:
            n = int(b.num_slots[p][row, layer])
            if n:
                k, v = self._read(p, b.flat_slots(row, layer, p, torch.arange(n)))
                ks.append(k)
                vs.append(v)
                ps.append(b.slot_position[p][row, layer, :n].long())
        shape = (0, self.cfg.num_kv_heads, self.cfg.head_dim)
        empty = torch.empty(shape, dtype=self.cfg.dtype, device=self.cfg.device)
        return (torch.cat(ps) if ps else torch.empty(0, dtype=torch.long), torch.cat(ks) if ks else empty,
                torch.cat(vs) if vs else empty)


assert TRASH_PAGE == 0   # the slot mappings' default (torch.zeros) is the trash page's first slot
