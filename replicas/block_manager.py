"""Host-side accounting of the paged KV cache: pages, bytes, slots and positions, no KV data.

The KV data lives in device pools allocated once (``replicas.kv_cache.KVCache``); this module
decides which page and slot every entry occupies. Each (sequence, layer, precision) keeps its
entries in dense slots ``0 .. n - 1`` over its page list; removing an entry moves the last one
into its place (attention does not depend on slot order: keys are stored after RoPE), so a page
returns to its pool as soon as it empties and bytes held always equal pages held.

Everything is an array indexed by a sequence's *row* (``0 .. max_num_seqs - 1``), so a decode step
updates the whole batch with a few array operations instead of a Python loop over sequences x
layers (vLLM v1's block tables, nano-vllm's ``BlockManager``). The arrays are tensors (the
attention kernels read the block tables); the per-step paths (:meth:`BlockManager.append_batch`,
:meth:`BlockManager.release_one`) index NumPy views of the same memory, a third of PyTorch's cost
per call on arrays this small (batch 8 x 6 layers: 54 against 140 us for the append, 84 against
192 us for the release; docs/engine.md):

====================  ============================  ===========================================
name                  shape, dtype                  meaning
====================  ============================  ===========================================
``block_table[p]``    [R, L, max_pages] int32       page ids of (row, layer) in precision p
``num_slots[p]``      [R, L] int64                  entries kept in precision p
``num_pages[p]``      [R, L] int64                  pages held in precision p
``slot_position[p]``  [R, L, max_pages * bs] int32  token position held by each slot
``location``          [R, L, max_model_len] int32   ``slot << 2 | precision`` of each position,
                                                    -1 where the position is not kept
``next_position``     [R, L] int64                  positions only grow: released ones never return
``row_bytes``         [R] int64                     bytes held per row (pages + block-table entries),
                                                    shared prefix pages included
``shared_pages``      [R] int64                     leading HIGH pages of every layer of the row that
                                                    belong to the prefix cache (read-only)
``snap_pages[p]``     [R, L] int64                  leading pages of (row, layer) in precision p
                                                    that belong to a compressed prefix of the cache
                                                    (copied to the row before they are changed)
====================  ============================  ===========================================

With a prefix cache (``replicas.prefix_cache``) the first ``shared_pages[row]`` HIGH pages of every
layer of a row are owned by the cache and may be referenced by several rows: ``row_bytes`` counts
them for each row (what the row reads), ``bytes_used`` once (what the pools hold), and they are
never written, swap-removed or returned to the free list by a row (``free`` hands them back to the
cache). ``bytes_used`` also holds cached pages no row references until the cache evicts them
(``evictor``: called when pages or budget run short). A compressed prefix (PASK's prompt side,
stored at its targets) is shared the same way per (layer, precision): the first
``snap_pages[p][row, layer]`` pages; before one of their entries is demoted or released the row
gets its own copy of them (:meth:`unshare`, copy-on-write).

Page 0 of every pool is never handed out: it is the *trash* page that batched stores of entries
that belong to another pool (or to none) write into, so a store has a fixed shape.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from replicas.precision import BITS, Precision

TRASH_PAGE = 0


class KVCacheOutOfMemory(RuntimeError):
    """The KV pool budget cannot hold the requested pages (the scheduler preempts on this)."""


def loc_of(slot: torch.Tensor, precision) -> torch.Tensor:
    """Packed ``slot << 2 | precision`` (int32)."""
    return (slot.to(torch.int32) << 2) | int(precision)


# ufunc reductions: one C call each (``ndarray.any()`` / ``.sum()`` go through two Python wrappers)
_any, _all, _sum = np.logical_or.reduce, np.logical_and.reduce, np.add.reduce


class ArrayViews:
    """NumPy arrays sharing memory with a :class:`BlockManager`'s tensors (allocated once, never
    reallocated, so the views stay valid)."""

    def __init__(self, bm: "BlockManager"):
        self.block_table = {p: t.numpy() for p, t in bm.block_table.items()}
        self.num_slots = {p: t.numpy() for p, t in bm.num_slots.items()}
        self.num_pages = {p: t.numpy() for p, t in bm.num_pages.items()}
        self.slot_position = {p: t.numpy() for p, t in bm.slot_position.items()}
        self.location, self.next_position = bm.location.numpy(), bm.next_position.numpy()
        self.row_bytes = bm.row_bytes.numpy()


class BlockManager:
    """Pages, slots and bytes of every (sequence row, layer, precision); see the module table.

    Args:
        num_layers, block_size, max_num_seqs (rows), max_model_len (positions per row).
        page_costs: bytes of one page (plus its block-table entry) per precision.
        capacities: pages of each pool, the trash page included.
        max_bytes: budget over all pools.
    """

    def __init__(self, num_layers: int, block_size: int, max_num_seqs: int, max_model_len: int,
                 page_costs: dict[Precision, int], capacities: dict[Precision, int], max_bytes: int):
        self.num_layers, self.block_size, self.max_bytes = num_layers, block_size, max_bytes
        self.max_model_len = max_model_len
        self.max_pages = math.ceil(max_model_len / block_size)
        self.page_costs, self.capacities = page_costs, capacities
        r, l, mp = max_num_seqs, num_layers, self.max_pages
        self.block_table = {p: torch.zeros(r, l, mp, dtype=torch.int32) for p in BITS}
        self.num_slots = {p: torch.zeros(r, l, dtype=torch.int64) for p in BITS}
        self.num_pages = {p: torch.zeros(r, l, dtype=torch.int64) for p in BITS}
        self.slot_position = {p: torch.zeros(r, l, mp * block_size, dtype=torch.int32) for p in BITS}
        self.location = torch.full((r, l, max_model_len), -1, dtype=torch.int32)
        self.next_position = torch.zeros(r, l, dtype=torch.int64)
        self.row_bytes = torch.zeros(r, dtype=torch.int64)
        self.shared_pages = torch.zeros(r, dtype=torch.int64)
        self.snap_pages = {p: torch.zeros(r, l, dtype=torch.int64) for p in BITS}
        # NumPy views of the same memory for the per-step batch paths (append_batch, release_one):
        # an index operation on a few dozen entries costs 0.6-1.2 us in NumPy, 2-4 us in PyTorch.
        self.views = ArrayViews(self)
        self.num_unshared_pages = 0   # compressed-prefix pages copied by unshare (copy-on-write)
        self.has_snapshots = False    # set once a compressed prefix is shared: only then are snap_pages checked
        self.has_shared = False       # set once a row reads shared prefix pages: only then are they checked
        self.bytes_used = 0
        # Set by a prefix cache: evictor(pages) frees up to ``pages`` unreferenced cached HIGH pages.
        self.evictor = None
        # Free pages per pool, the next one last (pop() from the end); page 0 is the trash page.
        # Pages never handed out lie at the bottom, highest first; ``handed[p]``: one above the
        # highest id ever handed out. See ``free`` for the order of the others.
        self.free_pages = {p: list(range(capacities[p] - 1, TRASH_PAGE, -1)) for p in BITS}
        self.handed = {p: TRASH_PAGE + 1 for p in BITS}
        self.unsorted: set = set()    # pools a freed sequence gave pages back to since their last sort
        self.rows: dict[object, int] = {}
        self.free_rows = list(range(r - 1, -1, -1))

    # ------------------------------------------------------------------ rows
    def add(self, seq_id) -> int:
        """Give ``seq_id`` an empty row.

        Raises:
            ValueError: the sequence already has a row, or every row is taken.
        """
        if seq_id in self.rows:
            raise ValueError(f"sequence {seq_id!r} already has a KV cache")
        if not self.free_rows:
            raise ValueError(f"the KV cache holds at most {len(self.rows)} sequences (max_num_seqs)")
        row = self.rows[seq_id] = self.free_rows.pop()
        self.location[row] = -1
        self.next_position[row] = 0
        for p in BITS:
            self.num_slots[p][row] = 0
        return row

    def free(self, seq_id) -> None:
        """Return every page of ``seq_id`` to its pool and its row (no-op for an unknown id)."""
        row = self.rows.pop(seq_id, None)
        if row is None:
            return
        shared = int(self.shared_pages[row])
        shared_bytes = shared * self.num_layers * self.page_costs[Precision.HIGH]
        for p in BITS:
            counts = self.num_pages[p][row]
            if int(counts.sum()):
                ar = torch.arange(self.max_pages)[None, :]
                mask = ar < counts[:, None]
                if shared and p == Precision.HIGH:   # the prefix cache's pages are not the row's to free
                    mask[:, :shared] = False
                mask &= ar >= self.snap_pages[p][row][:, None]
                self.give(p, self.block_table[p][row][mask].tolist())
                self.unsorted.add(p)
            counts.zero_()
            self.num_slots[p][row] = 0
            shared_bytes += int(self.snap_pages[p][row].sum()) * self.page_costs[p]
            self.snap_pages[p][row] = 0
        self.bytes_used -= int(self.row_bytes[row]) - shared_bytes
        self.row_bytes[row] = 0
        self.shared_pages[row] = 0
        self.free_rows.append(row)

    def attach_shared(self, row: int, pages: torch.Tensor) -> None:
        """Make the cached HIGH pages ``pages [L, k]`` (int32, full, positions ``0 .. k * bs - 1``
        in slot order in every layer) the first ``k`` pages of the empty ``row``; the row reads
        them and never writes or frees them. Charges ``row_bytes``, not ``bytes_used``.

        Raises:
            ValueError: the row already holds entries, or the pages' shape is wrong.
        """
        L, k = pages.shape
        n = k * self.block_size
        if L != self.num_layers or not 0 < n < self.max_model_len:
            raise ValueError(f"shared pages must be [{self.num_layers}, k] with k * block_size < "
                             f"{self.max_model_len}, got {tuple(pages.shape)}")
        if int(self.next_position[row].max()) or int(self.kept_counts(torch.tensor([row])).sum()):
            raise ValueError(f"row {row} already holds entries: a shared prefix goes first")
        h = Precision.HIGH
        slots = torch.arange(n)
        self.block_table[h][row, :, :k] = pages
        self.num_pages[h][row] = k
        self.num_slots[h][row] = n
        self.slot_position[h][row, :, :n] = slots.to(torch.int32)
        self.location[row, :, :n] = loc_of(slots, h)
        self.next_position[row] = n
        self.row_bytes[row] += k * self.num_layers * self.page_costs[h]
        self.shared_pages[row] = k
        self.has_shared = True

    def check_not_shared(self, rows: torch.Tensor, slots: torch.Tensor, p: Precision,
                         layers: torch.Tensor | None = None) -> None:
        """Raise ValueError if any ``slots`` of ``rows`` (and ``layers``; ``[n]`` each) lie in
        shared pages (a compressed prefix's must be :meth:`unshare` d first)."""
        if p == Precision.HIGH and self.has_shared and \
                bool((slots < self.shared_pages[rows] * self.block_size).any()):
            raise ValueError("a shared prefix page is read-only: its entries cannot be released or demoted")
        if layers is not None and self.has_snapshots and \
                bool((slots < self.snap_pages[p][rows, layers] * self.block_size).any()):
            raise ValueError("a compressed prefix page is shared: unshare it before changing its entries")

    def unshare(self, row: int, layer: int, p: Precision):
        """Copy-on-write: give (row, layer, p) its own pages for the compressed prefix pages it
        shares. Returns ``(dst, src)`` pool-flat indices of the data to copy.

        Raises:
            KVCacheOutOfMemory: the copies do not fit (nothing changes).
        """
        n = int(self.snap_pages[p][row, layer])
        empty = torch.empty(0, dtype=torch.int64)
        if not n:
            return empty, empty
        self.check_fits(n * self.page_costs[p], f"a copy of {n} shared {p.name} pages")
        ids = torch.tensor(self._take(p, n), dtype=torch.int64)
        old = self.block_table[p][row, layer, :n].long()
        self.block_table[p][row, layer, :n] = ids.to(torch.int32)
        self.snap_pages[p][row, layer] = 0
        self.bytes_used += n * self.page_costs[p]        # row_bytes counted them already
        self.num_unshared_pages += n
        ar = torch.arange(self.block_size)
        return (ids[:, None] * self.block_size + ar).flatten(), (old[:, None] * self.block_size + ar).flatten()

    # ------------------------------------------------------------------ pages
    @property
    def bytes_free(self) -> int:
        return self.max_bytes - self.bytes_used

    def _take(self, p: Precision, n: int) -> list[int]:
        free = self.free_pages[p]
        if n > len(free) and p == Precision.HIGH and self.evictor is not None:
            self.evictor(n - len(free))
        if n > len(free):
            raise KVCacheOutOfMemory(f"the {p.name} pool has {len(free)} free pages, {n} needed")
        if p in self.unsorted:
            self.unsorted.discard(p)
            self._sort_recycled(p)
        ids = free[len(free) - n:][::-1]     # the order of n pops
        del free[len(free) - n:]
        if ids and ids[-1] >= self.handed[p]:   # never-handed-out pages come last, ascending
            self.handed[p] = ids[-1] + 1
        return ids

    def give(self, p: Precision, ids: list[int]) -> None:
        """Return pages ``ids`` to pool ``p``, to be taken next and in the order given: the next
        prompt's pages after a compression released a run of pages are that run, ascending (a
        decode step's page that a release empties again is the one the step took)."""
        self.free_pages[p].extend(reversed(ids))

    def _sort_recycled(self, p: Precision) -> None:
        """Order pool ``p``'s free pages that were handed out before, lowest id next: after a
        sequence leaves, the next prompt's pages (taken together) are consecutive where the free
        ids allow, and read in page order they stream from memory. Taken off the top as freed,
        pages of sequences that grew side by side came back interleaved: PASK's INT8 pages at
        budget 0.33 and 2,048-token prompts were 0.7 % consecutive after two earlier runs, 98 %
        in a fresh pool, and the fused attention took 5.4 against 3.5 ms a decode step (batch 8,
        eager). Run by the first take after sequences were freed (one sort for all those freed
        in a step); it sorts the pages ever handed out, mostly in order already: 2-3 ms for
        262,000 of them (a 4 GiB float32 pool used whole once), 0.1-0.4 ms for 20,000."""
        free = self.free_pages[p]
        start = self.capacities[p] - self.handed[p]     # the never-handed-out pages below it
        recycled = free[start:]
        recycled.sort(reverse=True)
        free[start:] = recycled

    def check_fits(self, cost: int, what: str) -> None:
        if cost > self.bytes_free and self.evictor is not None:
            self.evictor(-(-(cost - self.bytes_free) // self.page_costs[Precision.HIGH]))
        if cost > self.bytes_free:
            raise KVCacheOutOfMemory(f"KV pool budget exhausted: need {cost} bytes for {what}, "
                                     f"{self.bytes_free} free of {self.max_bytes}")

    def _charge(self, row: int, nbytes: int) -> None:
        self.row_bytes[row] += nbytes
        self.bytes_used += nbytes

    def flat_slots(self, row: int, layers, p: Precision, slots: torch.Tensor) -> torch.Tensor:
        """Pool-flat indices (``page * block_size + offset``) of ``slots [n]`` (int64) of (row,
        ``layers``): one layer (int) or one per slot (``[n]`` int64)."""
        # (torch.div rather than //, here and below: a tensor's // runs through a Python wrapper,
        # five interpreter calls, on paths that run per step or per demotion)
        bs = self.block_size
        return self.block_table[p][row, layers, torch.div(slots, bs, rounding_mode="floor")].long() * bs + slots % bs

    # ------------------------------------------------------------------ one row, several layers
    def _new_pages(self, row: int, layers: torch.Tensor, p: Precision, counts: torch.Tensor) -> torch.Tensor:
        """``[U]`` pages (row, ``layers [U]``, p) must gain to hold ``counts [U]`` more entries.

        Raises:
            ValueError: more entries than ``max_model_len`` in a layer.
        """
        total = self.num_slots[p][row, layers] + counts
        if bool((total > self.max_pages * self.block_size).any()):
            raise ValueError(f"row {row}: {int(total.max())} entries exceed max_model_len {self.max_model_len}")
        return torch.div(total + self.block_size - 1, self.block_size, rounding_mode="floor") - self.num_pages[p][row, layers]

    def append(self, row: int, layers, p: Precision, positions: torch.Tensor) -> torch.Tensor:
        """Place new entries at ``positions [n]`` (int64, new to their layer) after the last slot of
        (row, layer, p), in the given order; ``layers``: one layer (int) or one per entry (``[n]``
        int64). Takes the pages needed first. Returns their pool-flat slots ``[n]`` (int64).

        Raises:
            KVCacheOutOfMemory: the new pages do not fit (nothing changes).
            ValueError: more entries than ``max_model_len`` in a layer.
        """
        n, bs = positions.shape[0], self.block_size
        if isinstance(layers, int):
            uniq, inv, counts = torch.tensor([layers]), torch.zeros(n, dtype=torch.int64), torch.tensor([n])
        else:
            uniq, inv, counts = torch.unique(layers, return_inverse=True, return_counts=True)
        need = self._new_pages(row, uniq, p, counts)
        num_new = int(need.sum())
        if num_new:
            self.check_fits(num_new * self.page_costs[p], f"{num_new} {p.name} pages")
            ids = torch.tensor(self._take(p, num_new), dtype=torch.int32)
            have = self.num_pages[p][row, uniq]
            first = torch.cumsum(need, 0) - need
            page = torch.arange(num_new) - first.repeat_interleave(need) + have.repeat_interleave(need)
            self.block_table[p][row, uniq.repeat_interleave(need), page] = ids
            self.num_pages[p][row, uniq] = have + need
            self._charge(row, num_new * self.page_costs[p])
        # slot of each entry: its layer's first free slot + its rank among that layer's entries
        order = torch.argsort(inv, stable=True)
        rank = torch.empty(n, dtype=torch.int64)
        rank[order] = torch.arange(n) - (torch.cumsum(counts, 0) - counts).repeat_interleave(counts)
        start = self.num_slots[p][row, uniq]
        slots = start[inv] + rank
        lay = uniq[inv]
        self.slot_position[p][row, lay, slots] = positions.to(torch.int32)
        self.location[row, lay, positions] = loc_of(slots, p)
        self.num_slots[p][row, uniq] = start + counts
        return self.flat_slots(row, lay, p, slots)

    def remove(self, row: int, layers, p: Precision, slots: torch.Tensor):
        """Swap-remove ``slots [n]`` (distinct) of (row, layer, p); ``layers``: one layer (int) or
        one per slot (``[n]`` int64). In each layer the last kept entries fill the holes (holes
        ascending, movers ascending) and emptied pages return to the pool. Returns ``(dst, src)``
        pool-flat indices of the data to move (``pool[dst] = pool[src]``).

        Raises:
            ValueError: a slot in a shared page (nothing changes).
        """
        if not slots.numel():
            empty = torch.empty(0, dtype=torch.int64)
            return empty, empty
        one_layer = isinstance(layers, int)
        lay = torch.full_like(slots, layers) if one_layer else layers
        self.check_not_shared(torch.full_like(slots, row), slots, p, lay if self.has_snapshots else None)
        if one_layer:   # (the common case: one layer's page released; no sort)
            uniq, inv = torch.tensor([layers]), torch.zeros_like(slots)
        else:
            uniq, inv = torch.unique(lay, return_inverse=True)
        n = self.num_slots[p][row, uniq]                                      # [U]
        width = int(n.max())
        drop = torch.zeros(uniq.shape[0], width, dtype=torch.bool)
        drop[inv, slots] = True
        keep_n = n - drop.sum(1)
        pos_of = self.slot_position[p][row, uniq, :width]                     # [U, width] (a copy)
        du, ds = drop.nonzero(as_tuple=True)
        self.location[row, uniq[du], pos_of[du, ds].long()] = -1
        ar = torch.arange(width)
        # Per layer, as many holes below keep_n as movers at or above it; row-major order pairs them.
        hu, hs = (drop & (ar < keep_n[:, None])).nonzero(as_tuple=True)
        mu, ms = (~drop & (ar >= keep_n[:, None]) & (ar < n[:, None])).nonzero(as_tuple=True)
        dst, src = self.flat_slots(row, uniq[hu], p, hs), self.flat_slots(row, uniq[mu], p, ms)
        if hu.numel():
            moved = pos_of[mu, ms]
            self.slot_position[p][row, uniq[hu], hs] = moved
            self.location[row, uniq[hu], moved.long()] = loc_of(hs, p)
        self.num_slots[p][row, uniq] = keep_n
        keep_pages = torch.div(keep_n + self.block_size - 1, self.block_size, rounding_mode="floor")
        have = self.num_pages[p][row, uniq]
        if bool((have > keep_pages).any()):
            cols = torch.arange(int(have.max()))
            freed = (cols >= keep_pages[:, None]) & (cols < have[:, None])
            self.give(p, self.block_table[p][row, uniq, : cols.numel()][freed].tolist())
            self.num_pages[p][row, uniq] = torch.minimum(have, keep_pages)
            self._charge(row, -int(freed.sum()) * self.page_costs[p])
        return dst, src

    def check_move_fits(self, row: int, layers: torch.Tensor, src: torch.Tensor, p: Precision) -> None:
        """Raise KVCacheOutOfMemory unless entries of (row, ``layers [n]``) in the pools ``src [n]``
        (Precision values) fit in pool ``p`` once they have left their pools (the pages they free
        count; nothing changes)."""
        uniq, counts = torch.unique(layers, return_counts=True)
        need = self._new_pages(row, uniq, p, counts)
        cost = int(need.sum()) * self.page_costs[p]
        for q in BITS:
            m = src == int(q)
            if bool(m.any()):
                u, c = torch.unique(layers[m], return_counts=True)
                keep_pages = torch.div(self.num_slots[q][row, u] - c + self.block_size - 1, self.block_size, rounding_mode="floor")
                cost -= int((self.num_pages[q][row, u] - keep_pages).sum()) * self.page_costs[q]
        if int(need.sum()) > len(self.free_pages[p]):
            raise KVCacheOutOfMemory(f"the {p.name} pool has {len(self.free_pages[p])} free pages, "
                                     f"{int(need.sum())} needed")
        if cost > 0:
            self.check_fits(cost, f"moving {layers.numel()} entries to {p.name}")

    # ------------------------------------------------------------------ a batch
    def append_batch(self, rows: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor | None):
        """Place one new token per row in every layer, in the pool its target names (a decode step).

        Args:
            rows: ``[B]`` int64 rows; positions: ``[B]`` int64, each above its row's last position.
            targets: ``[B, L]`` int64 Precision values (RELEASED: not stored), or None for all HIGH.
        Returns ``{precision: [L, B] int64 pool-flat slots}`` for each pool that stores any entry
        (entries bound elsewhere point at the trash page's slot 0).

        Raises:
            ValueError: a position not above its row's last one, or past ``max_model_len``.
            KVCacheOutOfMemory: the new pages do not fit (nothing changes).
        """
        v, L, bs = self.views, self.num_layers, self.block_size
        rows_n, pos_n = rows.numpy(), positions.numpy()
        b = rows_n.shape[0]
        stale = pos_n[:, None] < v.next_position[rows_n]
        if _any(stale, axis=None):
            bad = int(stale.any(1).nonzero()[0][0])
            raise ValueError(f"row {int(rows_n[bad])}: positions must be new and at least "
                             f"{int(v.next_position[rows_n[bad]].max())}, got {int(pos_n[bad])}")
        if _any(pos_n >= self.max_model_len):
            raise ValueError(f"positions past max_model_len {self.max_model_len}: {pos_n.tolist()[:8]}")
        if targets is None:
            pools = [(Precision.HIGH, None)]
        else:
            t = targets.numpy()
            pools = []
            for p in BITS:
                m = t == int(p)
                if _any(m, axis=None):
                    pools.append((p, m))
        plans, cost = [], 0
        for p, mask in pools:
            if mask is None:
                bi, li = np.divmod(np.arange(b * L), L)
            else:
                bi, li = mask.nonzero()
            slot = v.num_slots[p][rows_n[bi], li]
            opens = slot % bs == 0
            num_new = int(_sum(opens))
            cost += num_new * self.page_costs[p]
            plans.append((p, bi, li, slot, opens, num_new))
        self.check_fits(cost, "a decode step's pages")
        out = {}
        for p, bi, li, slot, opens, num_new in plans:
            r, table = rows_n[bi], v.block_table[p]
            if num_new:
                ro, lo = r[opens], li[opens]
                table[ro, lo, slot[opens] // bs] = self._take(p, num_new)
                v.num_pages[p][ro, lo] += 1
                np.add.at(v.row_bytes, ro, self.page_costs[p])
                self.bytes_used += num_new * self.page_costs[p]
            pos = pos_n[bi]
            v.slot_position[p][r, li, slot] = pos
            v.location[r, li, pos] = (slot << 2) | int(p)
            v.num_slots[p][r, li] += 1
            mapping = np.zeros((L, b), dtype=np.int64)                           # trash slot 0
            mapping[li, bi] = table[r, li, slot // bs].astype(np.int64) * bs + slot % bs
            out[p] = torch.from_numpy(mapping)
        v.next_position[rows_n] = (pos_n + 1)[:, None]
        return out

    def release_one(self, rows: torch.Tensor, layers: torch.Tensor, positions: torch.Tensor):
        """Release one kept entry per (row, layer) pair (pairs distinct) by swap-remove, as
        :meth:`remove` would one pair at a time. Returns ``{precision: (dst, src)}`` pool-flat
        indices of the data to move (``[n]`` int64 NumPy arrays)."""
        v, bs = self.views, self.block_size
        rows_n, layers_n, pos_n = rows.numpy(), layers.numpy(), positions.numpy()
        loc = v.location[rows_n, layers_n, pos_n]
        if _any(loc < 0):
            raise ValueError("release_one: a position is not kept")
        prec, slot = loc & 3, (loc >> 2).astype(np.int64)
        if self.has_shared or self.has_snapshots:   # (tensors: the checks are rare)
            t_prec, t_slot = torch.from_numpy(prec), torch.from_numpy(slot)
            high = t_prec == int(Precision.HIGH)
            self.check_not_shared(rows[high], t_slot[high], Precision.HIGH)
            if self.has_snapshots:
                for p in BITS:
                    m = t_prec == int(p)
                    self.check_not_shared(rows[m], t_slot[m], p, layers[m])
        v.location[rows_n, layers_n, pos_n] = -1
        out = {}
        for p in BITS:
            m = prec == int(p)
            if not _any(m):
                continue
            r, l, hole = rows_n[m], layers_n[m], slot[m]
            last = v.num_slots[p][r, l] - 1
            move = hole != last
            table = v.block_table[p]
            rm, lm, hm, sm = (r, l, hole, last) if _all(move) else (r[move], l[move], hole[move], last[move])
            dst = table[rm, lm, hm // bs].astype(np.int64) * bs + hm % bs
            src = table[rm, lm, sm // bs].astype(np.int64) * bs + sm % bs
            moved_pos = v.slot_position[p][rm, lm, sm]
            v.slot_position[p][rm, lm, hm] = moved_pos
            v.location[rm, lm, moved_pos] = (hm << 2) | int(p)
            v.num_slots[p][r, l] = last
            empty = last % bs == 0                                            # the last page emptied
            if _any(empty):
                re, le = r[empty], l[empty]
                self.give(p, table[re, le, last[empty] // bs].tolist())
                v.num_pages[p][re, le] -= 1
                np.subtract.at(v.row_bytes, re, self.page_costs[p])
                self.bytes_used -= int(_sum(empty)) * self.page_costs[p]
            out[p] = (dst, src)
        return out

    # ------------------------------------------------------------------ reads
    def kept_counts(self, rows: torch.Tensor) -> torch.Tensor:
        """``[B, L]`` entries kept per (row, layer), all precisions."""
        r, n = rows.numpy(), self.views.num_slots
        return torch.from_numpy(n[Precision.HIGH][r] + n[Precision.INT8][r] + n[Precision.INT4][r])

    def next_token_bytes(self, rows) -> int:
        """Bytes the next decode token of ``rows`` may need in all: a HIGH page in each layer whose
        HIGH pages are full, and a LOW (INT8-sized) page in each layer with a full LOW pool, where
        a policy may store or demote into. ``rows``: sequence rows (a list or an int64 array)."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size == 0:
            return 0
        bs, n = self.block_size, self.views.num_slots
        high = int(_sum(n[Precision.HIGH][rows] % bs == 0, axis=None))   # (ufunc reduces: one call each)
        low = int(_sum((n[Precision.INT8][rows] % bs == 0) | (n[Precision.INT4][rows] % bs == 0), axis=None))
        return high * self.page_costs[Precision.HIGH] + low * self.page_costs[Precision.INT8]

    def pages_held(self, row: int) -> int:
        """Bytes of a row recounted from its page counts (a check of ``row_bytes``)."""
        return sum(int(self.num_pages[p][row].sum()) * self.page_costs[p] for p in BITS)
