"""Automatic prefix caching: full-KV pages of a prompt prefix, shared read-only between sequences.

vLLM's automatic prefix caching (``vllm/v1/core/kv_cache_utils.py``, ``block_pool.py``) and
nano-vllm's ``BlockManager``, over this engine's block manager. A *block* is the ``block_size``
tokens of one page index of a prompt: its HIGH page in every layer (``[L]`` page ids). Its hash
chains the token ids of the block, the hash of the block before, and the cache's *key* (model,
KV policy and its settings, dtype, block size, table versions), so a hit means the same tokens
after the same prefix under the same model and tables: the same KV.

- **Lookup** (:meth:`PrefixCache.attach`, when the scheduler admits a sequence): the longest
  chain of cached blocks of the sequence's tokens, leaving at least one token to compute (its
  logits start decoding); the blocks become the row's first pages
  (``BlockManager.attach_shared``), referenced, and prefill starts after them (a chunk that
  starts later attends to what the sequence keeps: the chunked-prefill path).
- **Insertion** (:meth:`PrefixCache.register`, after a prefill forward succeeded): the row's
  full pages of computed tokens become cached blocks (ownership moves from the row to the cache;
  a block already cached under the same hash by another sequence stops the chain, and the row's
  copy stays private). Only pages whose every layer was written in a forward that completed are
  registered, so an abort or a forward that ran out of memory leaves no half-written block.
- **Release** (:meth:`PrefixCache.release`, before the row is freed: finish, abort,
  preemption): references drop; an unreferenced block stays cached and evictable, tail first.
- **Eviction** (``BlockManager.evictor``): least recently released unreferenced blocks go back
  to the free list when pages or the byte budget run short. :attr:`idle_bytes` is what
  admission may count as free.
- **Invalidation** (:meth:`set_key`, on a table publication or rollback): every entry of the old
  key is dropped; unreferenced pages are freed at once, referenced ones when their last
  sequence lets go.

Full KV shares cached pages in place: a shared page is never written, swap-removed or demoted
(the block manager refuses). A compressing policy (``PolicySpec.shares_prompt_pages`` False)
releases or demotes prompt entries inside pages, so its prompt in progress has a *shadow* row
that holds the cached blocks and the prompt at HIGH (its chunks attend to it: the same KV as a
whole-prompt prefill), and its own row gets the prefix copied at its targets
(``KVCache.copy_prefix``). Where those targets are known before the forward (PASK's prompt
side), the copy is itself cached (:class:`CompressedPrefix`, keyed by the chain and the targets)
and later hits share its full pages per (layer, precision), copied on write
(``BlockManager.unshare``) before one of their entries is demoted or released.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

from replicas.block_manager import BlockManager, loc_of
from replicas.precision import BITS, Precision

def check_policy(name: str, tensor_parallel_size: int = 1) -> None:
    """Raises ValueError: prefix caching is not supported with tensor parallelism."""
    if tensor_parallel_size != 1:
        raise ValueError("enable_prefix_caching is not supported with tensor_parallel_size > 1 yet "
                         "(the workers' block managers do not mirror the cache)")


def shadow_id(seq_id) -> tuple:
    """The block-manager row id of ``seq_id``'s full-precision shadow (see the module docstring)."""
    return ("shadow", seq_id)


@dataclass(eq=False)
class CachedBlock:
    """One cached block: ``pages [L]`` int32 HIGH page ids, referenced by ``refs`` sequences;
    ``stale``: dropped from the lookup table (old key), freed when ``refs`` reaches 0."""
    hash: bytes
    pages: torch.Tensor
    refs: int = 0
    stale: bool = False


@dataclass(eq=False)
class CompressedPrefix:
    """A prompt prefix of ``num_tokens`` tokens as a compressing policy stores it (PASK's prompt
    side: each (token, layer) at its target precision), shared by the rows that attach it.

    Per precision p: ``counts[p] [L]`` int64 entries of each layer, positions ascending in
    ``positions[p] [L, max n]`` int32; ``pages[p] [L, ceil(max n / bs)]`` int32 page ids, the
    full ones shared in place and, where ``counts % bs``, a last *tail* page that only the
    cache holds (a row gets its own copy of it, since the row goes on filling that page).
    ``nbytes``: what the cache's pages of it cost."""
    key: bytes
    num_tokens: int
    counts: dict
    positions: dict
    pages: dict
    nbytes: int
    refs: int = 0
    stale: bool = False


class PrefixCache:
    """Hash table of full-KV prefix blocks over one block manager (see the module docstring).

    Args:
        blocks: the block manager; the cache installs itself as its ``evictor``.
        key: anything with a stable ``repr`` naming the model, policy and table versions.
        shadow: the policy compresses its prompt: a prompt in progress holds the cached blocks
            in a full-precision shadow row, its own row a copy (``KVCache.attach_prefix``).
        keep: tokens at a prompt's end never taken from the cache (the policy's window).

    Attributes:
        queries, hits: prompt tokens looked up and tokens found cached (vLLM's
            ``prefix_cache_queries`` / ``prefix_cache_hits``), since the engine started.
        compressed_hits: prompt tokens attached from a shared compressed prefix.
    """

    def __init__(self, blocks: BlockManager, key, shadow: bool = False, keep: int = 1):
        self.blocks, self.bs = blocks, blocks.block_size
        self._key = repr(key).encode()
        self.table: dict[bytes, CachedBlock] = {}
        self.idle: OrderedDict[bytes, CachedBlock] = OrderedDict()   # refs == 0, LRU first
        self.seq_blocks: dict[object, list[CachedBlock]] = {}
        self.snapshots: dict[bytes, CompressedPrefix] = {}
        self.idle_snapshots: OrderedDict[bytes, CompressedPrefix] = OrderedDict()   # refs == 0, LRU first
        self.seq_snapshot: dict[object, CompressedPrefix] = {}
        self.queries = self.hits = 0
        self.compressed_hits = 0   # prompt tokens attached from a compressed prefix
        self.shadow, self.keep = shadow, max(1, keep)
        self._block_cost = blocks.num_layers * blocks.page_costs[Precision.HIGH]
        blocks.evictor = self.evict

    # ------------------------------------------------------------------ hashing
    def _hash(self, parent: bytes, tokens: list[int]) -> bytes:
        h = hashlib.blake2b(parent or self._key, digest_size=16)
        h.update(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes())
        return h.digest()

    def set_key(self, key) -> None:
        """Serve a new model / table version: entries of the old key are dropped (freed at once
        if unreferenced, else when their last sequence finishes)."""
        self._key = repr(key).encode()
        for entries, idle, free in ((self.table, self.idle, self._free),
                                    (self.snapshots, self.idle_snapshots, self._free_snapshot)):
            for entry in entries.values():   # referenced ones are freed when their last row lets go
                if entry.refs:
                    entry.stale = True
                else:
                    free(entry)
            entries.clear()
            idle.clear()

    # ------------------------------------------------------------------ lookup
    def match(self, token_ids: list[int], keep: int = 1) -> list[CachedBlock]:
        """The longest chain of cached blocks at the start of ``token_ids``, leaving at least
        ``keep`` (>= 1) tokens uncached (a policy's observation window is computed, not cached)."""
        out, parent = [], b""
        for j in range(max(0, len(token_ids) - max(1, keep)) // self.bs):
            h = self._hash(parent, token_ids[j * self.bs:(j + 1) * self.bs])
            block = self.table.get(h)
            if block is None:
                break
            out.append(block)
            parent = h
        return out

    def peek(self, token_ids: list[int], keep: int = 1) -> tuple[int, int]:
        """``(tokens cached, bytes of those blocks now unreferenced)`` for ``token_ids``, without
        taking them (admission: the idle ones are counted as free until taken)."""
        blocks = self.match(token_ids, keep)
        return len(blocks) * self.bs, sum(b.refs == 0 for b in blocks) * self._block_cost

    def attach(self, seq_id, token_ids: list[int], keep: int = 1) -> int:
        """Give the freshly added ``seq_id`` the cached prefix of ``token_ids``; returns the
        number of tokens it need not prefill (a multiple of ``block_size``; 0 on a miss)."""
        blocks = self.match(token_ids, keep)
        self.queries += len(token_ids)
        self.hits += len(blocks) * self.bs
        self.seq_blocks[seq_id] = blocks
        if not blocks:
            return 0
        for b in blocks:
            if b.refs == 0:
                self.idle.pop(b.hash, None)
            b.refs += 1
        self.blocks.attach_shared(self.blocks.rows[seq_id], torch.stack([b.pages for b in blocks], 1))
        return len(blocks) * self.bs

    # ------------------------------------------------------------------ insertion and release
    def register(self, seq_id, token_ids: list[int], num_computed: int) -> None:
        """Cache the full pages of ``token_ids[:num_computed]`` that ``seq_id`` holds privately
        (its KV for them is complete in every layer). Call after a forward that succeeded."""
        b = self.blocks
        row, have = b.rows[seq_id], self.seq_blocks.setdefault(seq_id, [])
        if int(b.shared_pages[row]) != len(have):
            raise RuntimeError(f"prefix cache out of step with row {row} of {seq_id!r}")
        full = num_computed // self.bs
        if full <= len(have):
            return
        if int(b.num_slots[Precision.HIGH][row].min()) < full * self.bs:
            raise RuntimeError(f"{seq_id!r}: prefix pages to cache are not full in every layer")
        parent = have[-1].hash if have else b""
        for j in range(len(have), full):
            h = self._hash(parent, token_ids[j * self.bs:(j + 1) * self.bs])
            if h in self.table:     # cached by another sequence meanwhile: this copy stays private
                break
            block = CachedBlock(h, b.block_table[Precision.HIGH][row, :, j].clone(), refs=1)
            self.table[h] = block
            have.append(block)
            parent = h
        b.shared_pages[row] = len(have)
        b.has_shared = b.has_shared or bool(have)

    def release(self, seq_id) -> None:
        """Drop ``seq_id``'s references (before its row is freed); unreferenced blocks become
        evictable, its last block first."""
        snap = self.seq_snapshot.pop(seq_id, None)
        if snap is not None:
            snap.refs -= 1
            if snap.refs == 0:
                if snap.stale:
                    self._free_snapshot(snap)
                else:
                    self.idle_snapshots[snap.key] = snap
        for block in reversed(self.seq_blocks.pop(seq_id, [])):
            block.refs -= 1
            if block.refs == 0:
                if block.stale:
                    self._free(block)
                else:
                    self.idle[block.hash] = block

    # ------------------------------------------------------------------ compressed prefixes
    def snapshot_key(self, shadow, num_tokens: int, targets: torch.Tensor) -> bytes:
        """Key of the compressed form of ``shadow``'s cached prefix (its first ``num_tokens``,
        the blocks it attached) at ``targets [num_tokens, L]``: the same tokens after the same
        blocks, stored at the same precision in every layer, is the same compressed KV."""
        blocks = self.seq_blocks.get(shadow, [])
        if len(blocks) * self.bs != num_tokens:
            raise RuntimeError(f"{shadow!r}: {num_tokens} tokens are not its {len(blocks)} cached blocks")
        h = hashlib.blake2b(blocks[-1].hash, digest_size=16)
        h.update(targets[:num_tokens].to(torch.int8).contiguous().numpy().tobytes())
        return h.digest()

    def attach_snapshot(self, seq_id, key: bytes) -> dict | None:
        """Give the freshly added, empty ``seq_id`` the compressed prefix ``key`` (None: not cached):
        its full pages shared, a private copy of each tail page. Returns ``{p: (dst, src)}``
        pool-flat indices of the tail data to copy.

        Raises:
            KVCacheOutOfMemory: the tail pages do not fit (nothing changes).
        """
        snap = self.snapshots.get(key)
        if snap is None:
            return None
        b, bs = self.blocks, self.bs
        row = b.rows[seq_id]
        tails = {p: (snap.counts[p] % bs > 0) for p in snap.counts}
        b.check_fits(sum(int(t.sum()) * b.page_costs[p] for p, t in tails.items()), "a compressed prefix's tail pages")
        moves = {}
        for p, counts in snap.counts.items():
            full = counts // bs
            new = iter(b._take(p, int(tails[p].sum())))
            dst, src = [], []
            for layer in range(b.num_layers):
                n, f = int(counts[layer]), int(full[layer])
                if not n:
                    continue
                pages = snap.pages[p][layer, :f + int(tails[p][layer])].clone()
                if tails[p][layer]:
                    tail = next(new)
                    dst.append(tail * bs + torch.arange(n - f * bs))
                    src.append(int(pages[f]) * bs + torch.arange(n - f * bs))
                    pages[f] = tail
                b.block_table[p][row, layer, :len(pages)] = pages
                b.num_pages[p][row, layer] = len(pages)
                b.num_slots[p][row, layer] = n
                pos = snap.positions[p][layer, :n]
                b.slot_position[p][row, layer, :n] = pos
                b.location[row, layer, pos.long()] = loc_of(torch.arange(n), p)
                b.snap_pages[p][row, layer] = f
                b.row_bytes[row] += len(pages) * b.page_costs[p]
            num_tails = int(tails[p].sum())
            b.bytes_used += num_tails * b.page_costs[p]
            if dst:
                moves[p] = (torch.cat(dst), torch.cat(src))
        b.next_position[row] = snap.num_tokens
        if snap.refs == 0:
            self.idle_snapshots.pop(key, None)
        snap.refs += 1
        self.seq_snapshot[seq_id] = snap
        self.compressed_hits += snap.num_tokens
        return moves

    def register_snapshot(self, seq_id, key: bytes, num_tokens: int) -> dict:
        """Share ``seq_id``'s row, which holds exactly its first ``num_tokens`` positions (stored
        at its targets, each (layer, precision) in position order), as the compressed prefix
        ``key``: its full pages become the cache's (shared in place), each tail page is copied
        into a page of the cache's own. Returns ``{p: (dst, src)}`` of the tail data to copy.
        A key already cached (or pages that do not fit) registers nothing.
        """
        b, bs = self.blocks, self.bs
        row = b.rows[seq_id]
        if key in self.snapshots or seq_id in self.seq_snapshot:
            return {}
        if bool((b.next_position[row] != num_tokens).any()):
            raise RuntimeError(f"{seq_id!r}: the row holds more than its {num_tokens}-token prefix")
        counts = {p: b.num_slots[p][row].clone() for p in BITS if int(b.num_slots[p][row].sum())}
        tails = {p: c % bs > 0 for p, c in counts.items()}
        cost = sum(int(t.sum()) * b.page_costs[p] for p, t in tails.items())
        if cost > b.bytes_free:
            return {}
        moves, pages, positions, nbytes = {}, {}, {}, cost
        for p, c in counts.items():
            width = int((-(-c // bs)).max())
            pages[p] = b.block_table[p][row, :, :width].clone()
            positions[p] = b.slot_position[p][row, :, :int(c.max())].clone()
            new = iter(b._take(p, int(tails[p].sum())))
            dst, src = [], []
            for layer in range(b.num_layers):
                n, f = int(c[layer]), int(c[layer]) // bs
                if n % bs:
                    tail = next(new)
                    dst.append(tail * bs + torch.arange(n - f * bs))
                    src.append(int(pages[p][layer, f]) * bs + torch.arange(n - f * bs))
                    pages[p][layer, f] = tail
            b.snap_pages[p][row] = c // bs
            nbytes += int((c // bs).sum()) * b.page_costs[p]
            if dst:
                moves[p] = (torch.cat(dst), torch.cat(src))
        b.bytes_used += cost
        b.has_snapshots = True
        snap = CompressedPrefix(key, num_tokens, counts, positions, pages, nbytes, refs=1)
        self.snapshots[key] = snap
        self.seq_snapshot[seq_id] = snap
        return moves

    def _free_snapshot(self, snap: CompressedPrefix) -> None:
        b, bs = self.blocks, self.bs
        for p, c in snap.counts.items():
            n_pages = -(-c // bs)
            for layer in range(b.num_layers):
                b.give(p, snap.pages[p][layer, :int(n_pages[layer])].tolist())
        b.bytes_used -= snap.nbytes

    # ------------------------------------------------------------------ eviction
    @property
    def idle_bytes(self) -> int:
        """Bytes of cached blocks and compressed prefixes no sequence references (evictable)."""
        return len(self.idle) * self._block_cost + sum(s.nbytes for s in self.idle_snapshots.values())

    @property
    def cached_bytes(self) -> int:
        """Bytes of every cached block, referenced or not (stale ones still referenced included)."""
        snaps = {id(x): x for x in self.seq_snapshot.values()} | {id(x): x for x in self.snapshots.values()}
        return len({id(b) for bl in self.seq_blocks.values() for b in bl} | {id(b) for b in self.table.values()}) \
            * self._block_cost + sum(x.nbytes for x in snaps.values())

    def evict(self, num_pages: int) -> int:
        """Free least recently used unreferenced blocks until ``num_pages`` HIGH pages are free
        (or none is left); returns the pages freed."""
        freed, high = 0, self.blocks.page_costs[Precision.HIGH]
        while freed < num_pages and self.idle_snapshots:     # a compressed prefix first: it is only
            _, snap = self.idle_snapshots.popitem(last=False)  # reached through its cached blocks
            del self.snapshots[snap.key]
            self._free_snapshot(snap)
            freed += snap.nbytes // high
        while freed < num_pages and self.idle:
            _, block = self.idle.popitem(last=False)
            del self.table[block.hash]
            self._free(block)
            freed += block.pages.numel()
        return freed

    def _free(self, block: CachedBlock) -> None:
        self.blocks.give(Precision.HIGH, block.pages.tolist())
        self.blocks.bytes_used -= self._block_cost

    # ------------------------------------------------------------------ checks
    def audit(self) -> None:
        """Recount references, pages and bytes from scratch (tests).

        Raises:
            AssertionError: an inconsistency, said what.
        """
        b = self.blocks
        refs: dict[int, int] = {}
        for seq_id, blocks in self.seq_blocks.items():
            assert int(b.shared_pages[b.rows[seq_id]]) == len(blocks), f"{seq_id!r}: shared page count"
            for j, block in enumerate(blocks):
                refs[id(block)] = refs.get(id(block), 0) + 1
                assert torch.equal(b.block_table[Precision.HIGH][b.rows[seq_id], :, j], block.pages), "pages"
        live = {id(x): x for bl in self.seq_blocks.values() for x in bl} | {id(x): x for x in self.table.values()}
        for i, block in live.items():
            assert block.refs == refs.get(i, 0), f"refs {block.refs} != {refs.get(i, 0)}"
            assert (block.refs == 0) == (block.hash in self.idle and not block.stale), "idle list"
        snaps = {id(x): x for x in self.seq_snapshot.values()} | {id(x): x for x in self.snapshots.values()}
        snap_refs: dict[int, int] = {}
        for seq_id, snap in self.seq_snapshot.items():
            snap_refs[id(snap)] = snap_refs.get(id(snap), 0) + 1
        for i, snap in snaps.items():
            assert snap.refs == snap_refs.get(i, 0), f"snapshot refs {snap.refs} != {snap_refs.get(i, 0)}"
            assert (snap.refs == 0) == (snap.key in self.idle_snapshots and not snap.stale), "idle snapshots"
            for p, c in snap.counts.items():
                full = c // self.bs
                for seq_id, s2 in self.seq_snapshot.items():
                    if s2 is snap:   # a row shares a prefix of the snapshot's full pages (fewer once unshared)
                        r = b.rows[seq_id]
                        k = b.snap_pages[p][r]
                        assert bool((k <= full).all()), "a row shares more pages than the snapshot has"
                        for lay in range(b.num_layers):
                            assert torch.equal(b.block_table[p][r, lay, :int(k[lay])], snap.pages[p][lay, :int(k[lay])]), \
                                "shared compressed pages"
        rows_bytes = sum(int(b.row_bytes[r]) - int(b.shared_pages[r]) * self._block_cost
                         - sum(int(b.snap_pages[p][r].sum()) * b.page_costs[p] for p in BITS) for r in b.rows.values())
        assert b.bytes_used == rows_bytes + len(live) * self._block_cost + sum(x.nbytes for x in snaps.values()), \
            "bytes_used"
        for p in b.free_pages:
            held = [int(x) for r in b.rows.values() for lay in range(b.num_layers)
                    for x in b.block_table[p][r, lay, max(int(b.shared_pages[r]) if p == Precision.HIGH else 0,
                                                          int(b.snap_pages[p][r, lay])):
                                              int(b.num_pages[p][r, lay])]]
            if p == Precision.HIGH:
                held += [int(x) for blk in live.values() for x in blk.pages]
            for snap in snaps.values():
                if p in snap.counts:
                    n_pages = -(-snap.counts[p] // self.bs)
                    held += [int(x) for lay in range(b.num_layers) for x in snap.pages[p][lay, :int(n_pages[lay])]]
            assert len(set(held)) == len(held), f"{p.name}: a page held twice"
            assert not set(held) & set(b.free_pages[p]), f"{p.name}: a held page is free"
            assert len(set(b.free_pages[p])) == len(b.free_pages[p]), f"{p.name}: a page freed twice"
            assert len(held) + len(b.free_pages[p]) == b.capacities[p] - 1, f"{p.name}: a page leaked"
