"""Paged, mixed-precision, compressible KV cache.

Every (sequence, layer, token) entry is kept at HIGH precision (the model dtype), kept quantized
(INT8, or INT4 packed two per byte; one float32 scale per token and KV head) or released. Each
precision has its own page pool; a page holds ``block_size`` slots of one (sequence, layer). The
slots of a (sequence, layer, precision) stay dense: removing an entry moves the last one into its
place (attention does not depend on slot order, since keys are stored after RoPE), so a page is
returned to its pool as soon as it empties and bytes held always equal pages held.

Keys are stored after RoPE, and each entry records its token's true position, so releasing tokens
never shifts the positions of later ones.

Byte accounting is exact: a page costs its K and V data, its scales (quantized pools) and its
int32 position column; each page also costs one int32 block-table entry.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

import kernels


class Precision(enum.IntEnum):
    """Storage level of a KV entry, cheapest first (RELEASED holds nothing)."""
    RELEASED = 0
    INT4 = 1
    INT8 = 2
    HIGH = 3


BITS = {Precision.HIGH: 0, Precision.INT8: 8, Precision.INT4: 4}
BLOCK_TABLE_ENTRY_BYTES = 4


class KVCacheOutOfMemory(RuntimeError):
    """The KV pool budget cannot hold the requested pages (the scheduler preempts on this)."""


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
        initial_pages: pages first allocated per pool; pools double on demand up to the budget.
    """
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    block_size: int = 16
    max_bytes: int = 1 << 30
    device: str = "cpu"
    initial_pages: int = 64

    def __post_init__(self):
        if min(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size) < 1:
            raise ValueError(f"KV cache dimensions must be positive: {self}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (INT4 packs pairs), got {self.head_dim}")
        if self.max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {self.max_bytes}")


class _Pool:
    """Pages of one precision, shared by all sequences and layers."""

    def __init__(self, cfg: KVCacheConfig, precision: Precision):
        self.cfg, self.precision, self.bits = cfg, precision, BITS[precision]
        h, d, bs = cfg.num_kv_heads, cfg.head_dim, cfg.block_size
        if self.bits == 0:
            self.data_dtype, self.data_dim = cfg.dtype, d
        else:
            self.data_dtype = torch.int8 if self.bits == 8 else torch.uint8
            self.data_dim = d if self.bits == 8 else d // 2
        elem = torch.empty((), dtype=self.data_dtype).element_size()
        scales = 2 * h * 4 if self.bits else 0
        self.page_bytes = bs * (2 * h * self.data_dim * elem + scales + 4)
        self.capacity = 0
        self.free_pages: list[int] = []
        self.k = self.v = self.k_scale = self.v_scale = self.positions = None
        self._grow(cfg.initial_pages)

    def _grow(self, pages: int) -> None:
        cfg, old = self.cfg, self.capacity
        new = old + pages
        shape = (new, cfg.block_size, cfg.num_kv_heads, self.data_dim)

        def extend(t, shape, dtype):
            fresh = torch.zeros(shape, dtype=dtype, device=cfg.device)
            if t is not None:
                fresh[:old] = t
            return fresh
        self.k = extend(self.k, shape, self.data_dtype)
        self.v = extend(self.v, shape, self.data_dtype)
        if self.bits:
            self.k_scale = extend(self.k_scale, shape[:3], torch.float32)
            self.v_scale = extend(self.v_scale, shape[:3], torch.float32)
        self.positions = extend(self.positions, shape[:2], torch.int32)
        self.free_pages.extend(range(new - 1, old - 1, -1))
        self.capacity = new

    def alloc(self) -> int:
        if not self.free_pages:
            self._grow(max(self.capacity, 1))
        return self.free_pages.pop()

    def flat(self, name: str) -> torch.Tensor:
        """A pool tensor viewed with pages and slots flattened: ``[P * bs, ...]``."""
        t = getattr(self, name)
        return t.view(-1, *t.shape[2:])


class _Entries:
    """The dense slots of one (sequence, layer, precision): page list and position per slot."""
    __slots__ = ("pages", "positions")

    def __init__(self):
        self.pages: list[int] = []
        self.positions: list[int] = []

    def flat_slots(self, slots, block_size: int, device) -> torch.Tensor:
        slots = torch.as_tensor(slots, dtype=torch.long)
        pages = torch.tensor(self.pages, dtype=torch.long)
        return (pages[slots // block_size] * block_size + slots % block_size).to(device)


def _loc(prec: Precision, slot: int) -> int:
    """(precision, slot) packed in one int: ``where`` maps every kept token, and ints, unlike
    tuples, are not tracked by Python's cycle collector (tuples made its passes dominate a long
    prefill's bookkeeping)."""
    return slot << 2 | prec


def _unloc(loc: int) -> tuple[Precision, int]:
    return Precision(loc & 3), loc >> 2


class SequenceKV:
    """KV entries of one sequence: per layer, per precision, plus position -> packed
    (precision, slot) (:func:`_loc`)."""

    def __init__(self, num_layers: int):
        self.entries = [{p: _Entries() for p in BITS} for _ in range(num_layers)]
        self.where: list[dict[int, int]] = [{} for _ in range(num_layers)]
        self.next_position = [0] * num_layers  # positions only grow: released ones never return
        self.bytes = 0                             # its pages and their block-table entries


class KVCache:
    """The KV store of one engine rank. All operations are per (sequence, layer, token)."""

    def __init__(self, cfg: KVCacheConfig):
        self.cfg = cfg
        self.pools = {p: _Pool(cfg, p) for p in BITS}
        self.seqs: dict[object, SequenceKV] = {}
        self.bytes_used = 0

    # ------------------------------------------------------------------ accounting
    def page_cost(self, precision: Precision) -> int:
        return self.pools[precision].page_bytes + BLOCK_TABLE_ENTRY_BYTES

    def sequence_bytes(self, seq_id) -> int:
        """Bytes held by one sequence: its pages and their block-table entries."""
        return self.seqs[seq_id].bytes

    def next_token_bytes(self, seq_id) -> int:
        """Bytes the next decode token of a sequence may need: a HIGH page in each layer whose
        HIGH pages are full, and a LOW (INT8-sized) page in each layer with a full LOW pool, where
        a policy may demote into."""
        bs, high, low = self.cfg.block_size, self.page_cost(Precision.HIGH), self.page_cost(Precision.INT8)
        need = 0
        for layer in self.seqs[seq_id].entries:
            if len(layer[Precision.HIGH].positions) % bs == 0:
                need += high
            if len(layer[Precision.INT8].positions) % bs == 0 or len(layer[Precision.INT4].positions) % bs == 0:
                need += low
        return need

    def full_kv_bytes(self, num_tokens: int) -> int:
        """Bytes that full KV (HIGH, all layers) would hold for ``num_tokens`` tokens."""
        return self.cfg.num_layers * math.ceil(num_tokens / self.cfg.block_size) * self.page_cost(Precision.HIGH)

    @property
    def bytes_free(self) -> int:
        return self.cfg.max_bytes - self.bytes_used

    def num_kept(self, seq_id, layer: int, precision: Precision | None = None) -> int:
        e = self.seqs[seq_id].entries[layer]
        return sum(len(x.positions) for p, x in e.items() if precision in (None, p))

    def kept(self, seq_id, layer: int) -> dict[int, Precision]:
        """Position -> precision of every entry kept for (sequence, layer)."""
        return {pos: Precision(loc & 3) for pos, loc in self.seqs[seq_id].where[layer].items()}

    # ------------------------------------------------------------------ sequences
    def add_sequence(self, seq_id) -> None:
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} already has a KV cache")
        self.seqs[seq_id] = SequenceKV(self.cfg.num_layers)

    def free_sequence(self, seq_id) -> None:
        kv = self.seqs.pop(seq_id, None)
        if kv is None:
            return
        for layer in kv.entries:
            for prec, e in layer.items():
                self.pools[prec].free_pages.extend(e.pages)
        self.bytes_used -= kv.bytes

    # ------------------------------------------------------------------ writes
    def _reserve(self, kv: SequenceKV, e: _Entries, prec: Precision, num_slots: int) -> None:
        bs = self.cfg.block_size
        need = math.ceil(num_slots / bs) - len(e.pages)
        if need <= 0:
            return
        cost = need * self.page_cost(prec)
        if cost > self.bytes_free:
            raise KVCacheOutOfMemory(f"KV pool budget exhausted: need {cost} bytes for {need} "
                                     f"{prec.name} pages, {self.bytes_free} free of {self.cfg.max_bytes}")
        pool = self.pools[prec]
        e.pages.extend(pool.alloc() for _ in range(need))
        self.bytes_used += cost
        kv.bytes += cost

    def _write(self, seq_id, layer: int, positions: list[int], k: torch.Tensor, v: torch.Tensor,
               prec: Precision) -> None:
        kv = self.seqs[seq_id]
        e, where = kv.entries[layer][prec], kv.where[layer]
        start = len(e.positions)
        self._reserve(kv, e, prec, start + len(positions))
        slots = range(start, start + len(positions))
        flat = e.flat_slots(slots, self.cfg.block_size, self.cfg.device)
        pool = self.pools[prec]
        if prec == Precision.HIGH:
            pool.flat("k")[flat] = k.to(pool.data_dtype)
            pool.flat("v")[flat] = v.to(pool.data_dtype)
        else:
            kernels.quantize_store(k, pool.flat("k"), pool.flat("k_scale"), flat, pool.bits)
            kernels.quantize_store(v, pool.flat("v"), pool.flat("v_scale"), flat, pool.bits)
        pool.flat("positions")[flat] = torch.tensor(positions, dtype=torch.int32, device=self.cfg.device)
        e.positions.extend(positions)
        where.update(zip(positions, range(_loc(prec, slots.start), _loc(prec, slots.stop), 4)))  # consecutive slots

    def append(self, seq_id, layer: int, positions, k: torch.Tensor, v: torch.Tensor,
               precision: Precision = Precision.HIGH) -> None:
        """Store new tokens of one (sequence, layer).

        Args:
            positions: ``[n]`` true token positions (ints), none of them already stored here.
            k, v: ``[n, Hkv, D]``, keys after RoPE.
            precision: HIGH, INT8 or INT4.

        Raises:
            KVCacheOutOfMemory: the pool budget cannot hold the new pages (nothing is written).
            ValueError: positions not above every position stored before in this layer
                (or repeated), or a shape mismatch.
        """
        positions = [int(p) for p in positions]
        if k.shape != v.shape or k.shape != (len(positions), self.cfg.num_kv_heads, self.cfg.head_dim):
            raise ValueError(f"k, v must be [{len(positions)}, {self.cfg.num_kv_heads}, "
                             f"{self.cfg.head_dim}], got {tuple(k.shape)}, {tuple(v.shape)}")
        kv = self.seqs[seq_id]
        if not positions:
            return
        if min(positions) < kv.next_position[layer] or len(set(positions)) != len(positions):
            raise ValueError(f"sequence {seq_id!r}, layer {layer}: positions must be new and at least "
                             f"{kv.next_position[layer]}, got {positions[:8]}")
        if precision != Precision.RELEASED:
            self._write(seq_id, layer, positions, k, v, Precision(precision))
        kv.next_position[layer] = max(positions) + 1

    def append_decode(self, seq_ids: list, layer: int, positions: list[int], k: torch.Tensor,
                      v: torch.Tensor) -> None:
        """Store one new token per sequence of a decode step, at HIGH precision, in one write
        (what :meth:`append` does per sequence, without a Python round trip each).

        Args:
            seq_ids: B sequences; positions: their B new positions (ints).
            k, v: ``[B, Hkv, D]``, keys after RoPE.

        Raises:
            KVCacheOutOfMemory: the pages the batch needs do not fit (nothing is written).
            ValueError: a position not above the sequence's last one in this layer, or a shape mismatch.
        """
        b, bs, high = len(seq_ids), self.cfg.block_size, Precision.HIGH
        if k.shape != v.shape or k.shape != (b, self.cfg.num_kv_heads, self.cfg.head_dim) or len(positions) != b:
            raise ValueError(f"k, v must be [{b}, {self.cfg.num_kv_heads}, {self.cfg.head_dim}] with {b} "
                             f"positions, got {tuple(k.shape)}, {tuple(v.shape)}, {len(positions)}")
        kvs = [self.seqs[s] for s in seq_ids]
        need = 0
        for sid, kv, pos in zip(seq_ids, kvs, positions):
            if pos < kv.next_position[layer]:
                raise ValueError(f"sequence {sid!r}, layer {layer}: positions must be new and at least "
                                 f"{kv.next_position[layer]}, got {pos}")
            need += len(kv.entries[layer][high].positions) % bs == 0
        if need * self.page_cost(high) > self.bytes_free:
            raise KVCacheOutOfMemory(f"KV pool budget exhausted: need {need * self.page_cost(high)} bytes for "
                                     f"{need} HIGH pages, {self.bytes_free} free of {self.cfg.max_bytes}")
        flat = []
        for kv, pos in zip(kvs, positions):
            e = kv.entries[layer][high]
            slot = len(e.positions)
            self._reserve(kv, e, high, slot + 1)
            flat.append(e.pages[slot // bs] * bs + slot % bs)
            e.positions.append(pos)
            kv.where[layer][pos] = _loc(high, slot)
            kv.next_position[layer] = pos + 1
        pool = self.pools[high]
        idx = torch.tensor(flat, dtype=torch.long, device=self.cfg.device)
        pool.flat("k")[idx] = k.to(pool.data_dtype)
        pool.flat("v")[idx] = v.to(pool.data_dtype)
        pool.flat("positions")[idx] = torch.tensor(positions, dtype=torch.int32, device=self.cfg.device)

    def _remove(self, seq_id, layer: int, prec: Precision, slots: list[int]) -> None:
        """Swap-remove slots from a (sequence, layer, precision); frees emptied pages."""
        kv = self.seqs[seq_id]
        e, where, bs = kv.entries[layer][prec], kv.where[layer], self.cfg.block_size
        n, drop = len(e.positions), set(slots)
        keep_n = n - len(drop)
        for s in drop:
            del where[e.positions[s]]
        holes = sorted(s for s in drop if s < keep_n)
        movers = [s for s in range(keep_n, n) if s not in drop]
        if holes:
            pool = self.pools[prec]
            dst = e.flat_slots(holes, bs, self.cfg.device)
            src = e.flat_slots(movers, bs, self.cfg.device)
            for name in ("k", "v", "k_scale", "v_scale", "positions"):
                if getattr(pool, name) is not None:
                    t = pool.flat(name)
                    t[dst] = t[src]
            for h, m in zip(holes, movers):
                e.positions[h] = e.positions[m]
                where[e.positions[h]] = _loc(prec, h)
        del e.positions[keep_n:]
        keep_pages = math.ceil(keep_n / bs)
        freed = e.pages[keep_pages:]
        del e.pages[keep_pages:]
        self.pools[prec].free_pages.extend(freed)
        self.bytes_used -= len(freed) * self.page_cost(prec)
        kv.bytes -= len(freed) * self.page_cost(prec)

    def _read(self, seq_id, layer: int, prec: Precision, slots: list[int]):
        pool = self.pools[prec]
        flat = self.seqs[seq_id].entries[layer][prec].flat_slots(slots, self.cfg.block_size, self.cfg.device)
        if prec == Precision.HIGH:
            return pool.flat("k")[flat], pool.flat("v")[flat]
        return (kernels.dequantize_ref(pool.flat("k")[flat], pool.flat("k_scale")[flat], pool.bits, self.cfg.dtype),
                kernels.dequantize_ref(pool.flat("v")[flat], pool.flat("v_scale")[flat], pool.bits, self.cfg.dtype))

    def set_precision(self, seq_id, layer: int, positions, precision: Precision) -> int:
        """Demote kept tokens to ``precision`` (INT8, INT4) or release them (RELEASED).

        Tokens already at or below ``precision`` are left as they are (precision never rises:
        dropped bits and released tokens never come back). Returns bytes freed (may be negative
        when demoting fills a new LOW page).

        Raises:
            KVCacheOutOfMemory: a demotion needs a LOW page the budget cannot hold (nothing changes).
        """
        precision = Precision(precision)
        kv = self.seqs[seq_id]
        where = kv.where[layer]
        by_source: dict[Precision, list[int]] = {}
        moved: dict[Precision, list[int]] = {}
        for pos in positions:
            loc = where.get(int(pos))
            if loc is None:
                continue
            src, slot = _unloc(loc)
            if src > precision:
                by_source.setdefault(src, []).append(slot)
                moved.setdefault(src, []).append(int(pos))
        if not by_source:
            return 0
        bs = self.cfg.block_size
        flat = [p for ps in moved.values() for p in ps]
        if precision != Precision.RELEASED and len(flat) > bs:
            # One page at a time: each chunk needs at most one new LOW page and frees a page of its
            # source pool, so a demotion never needs much more memory than it started with.
            return sum(self.set_precision(seq_id, layer, flat[i:i + bs], precision) for i in range(0, len(flat), bs))
        before = self.bytes_used
        if precision != Precision.RELEASED:
            target = kv.entries[layer][precision]
            total = len(target.positions) + sum(len(s) for s in by_source.values())
            self._reserve(kv, target, precision, total)
        for prec, slots in by_source.items():
            if precision != Precision.RELEASED:
                k, v = self._read(seq_id, layer, prec, slots)
            self._remove(seq_id, layer, prec, slots)
            if precision != Precision.RELEASED:
                self._write(seq_id, layer, moved[prec], k, v, precision)
        return before - self.bytes_used

    # ------------------------------------------------------------------ reads
    def gather(self, seq_id, layer: int):
        """All kept entries of (sequence, layer), dequantized to the model dtype.

        Returns ``(positions [n] int64, k [n, Hkv, D], v [n, Hkv, D])``, HIGH entries first.
        """
        ks, vs, ps = [], [], []
        for prec, e in self.seqs[seq_id].entries[layer].items():
            if e.positions:
                k, v = self._read(seq_id, layer, prec, list(range(len(e.positions))))
                ks.append(k)
                vs.append(v)
                ps.extend(e.positions)
        shape = (0, self.cfg.num_kv_heads, self.cfg.head_dim)
        empty = torch.empty(shape, dtype=self.cfg.dtype, device=self.cfg.device)
        return (torch.tensor(ps, dtype=torch.long), torch.cat(ks) if ks else empty,
                torch.cat(vs) if vs else empty)

    def decode_attention(self, seq_ids: list, layer: int, q: torch.Tensor,
                         sm_scale: float | None = None) -> torch.Tensor:
        """Attention of one query per sequence over its kept entries of ``layer``.

        Args:
            q: ``[B, Hq, D]`` for ``seq_ids`` in order.
        Returns ``[B, Hq, D]`` in ``q``'s dtype; HIGH, INT8 and INT4 pools merged exactly.
        """
        outs, lses = [], []
        active = []
        for prec, pool in self.pools.items():
            entries = [self.seqs[s].entries[layer][prec] for s in seq_ids]
            lens = [len(e.positions) for e in entries]
            if any(lens):
                active.append((pool, entries, lens))
        for pool, entries, lens in active:
            width = max(len(e.pages) for e in entries)
            table = torch.tensor([e.pages + [0] * (width - len(e.pages)) for e in entries], dtype=torch.int32)
            out, lse = kernels.paged_decode_attention(
                q, pool.k, pool.v, pool.k_scale, pool.v_scale, table.to(self.cfg.device),
                torch.tensor(lens, dtype=torch.int32, device=self.cfg.device), pool.bits, sm_scale,
                need_lse=len(active) > 1)
            outs.append(out)
            lses.append(lse)
        if not outs:
            raise ValueError(f"layer {layer}: no kept KV entries for sequences {seq_ids}")
        merged = outs[0] if len(outs) == 1 else kernels.merge_attention_states(outs, lses)
        return merged.to(q.dtype)
