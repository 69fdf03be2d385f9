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

Only full-KV sequences share pages: a shared page is never written, swap-removed or demoted
(the block manager refuses), and every other policy releases or demotes prompt entries inside
pages (``check_policy``).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

from replicas.block_manager import BlockManager
from replicas.precision import Precision

# Policies whose prompt entries stay where prefill wrote them (HIGH, slot order, never released).
SHAREABLE_POLICIES = ("full",)


def check_policy(name: str, tensor_parallel_size: int = 1) -> None:
    """Raises ValueError: prefix caching is not supported for this policy or tensor parallelism."""
    if name not in SHAREABLE_POLICIES:
        raise ValueError(f"enable_prefix_caching supports kv_policy {', '.join(map(repr, SHAREABLE_POLICIES))} "
                         f"only, not {name!r}: it releases or demotes prompt entries inside pages, and a "
                         f"shared prefix page is read-only (compressed prefix reuse is not built yet)")
    if tensor_parallel_size != 1:
        raise ValueError("enable_prefix_caching is not supported with tensor_parallel_size > 1 yet "
                         "(the workers' block managers do not mirror the cache)")


@dataclass(eq=False)
class CachedBlock:
    """One cached block: ``pages [L]`` int32 HIGH page ids, referenced by ``refs`` sequences;
    ``stale``: dropped from the lookup table (old key), freed when ``refs`` reaches 0."""
    hash: bytes
    pages: torch.Tensor
    refs: int = 0
    stale: bool = False


class PrefixCache:
    """Hash table of full-KV prefix blocks over one block manager (see the module docstring).

    Args:
        blocks: the block manager; the cache installs itself as its ``evictor``.
        key: anything with a stable ``repr`` naming the model, policy and table versions.

    Attributes:
        queries, hits: prompt tokens looked up and tokens found cached (vLLM's
            ``prefix_cache_queries`` / ``prefix_cache_hits``), since the engine started.
    """

    def __init__(self, blocks: BlockManager, key):
        self.blocks, self.bs = blocks, blocks.block_size
        self._key = repr(key).encode()
        self.table: dict[bytes, CachedBlock] = {}
        self.idle: OrderedDict[bytes, CachedBlock] = OrderedDict()   # refs == 0, LRU first
        self.seq_blocks: dict[object, list[CachedBlock]] = {}
        self.queries = self.hits = 0
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
        for block in self.table.values():
            if block.refs:
                block.stale = True
            else:
                self._free(block)
        self.table.clear()
        self.idle.clear()

    # ------------------------------------------------------------------ lookup
    def match(self, token_ids: list[int]) -> list[CachedBlock]:
        """The longest chain of cached blocks at the start of ``token_ids``, leaving at least one
        token uncached."""
        out, parent = [], b""
        for j in range((len(token_ids) - 1) // self.bs):
            h = self._hash(parent, token_ids[j * self.bs:(j + 1) * self.bs])
            block = self.table.get(h)
            if block is None:
                break
            out.append(block)
            parent = h
        return out

    def peek(self, token_ids: list[int]) -> tuple[int, int]:
        """``(tokens cached, bytes of those blocks now unreferenced)`` for ``token_ids``, without
        taking them (admission: the idle ones are counted as free until taken)."""
        blocks = self.match(token_ids)
        return len(blocks) * self.bs, sum(b.refs == 0 for b in blocks) * self._block_cost

    def attach(self, seq_id, token_ids: list[int]) -> int:
        """Give the freshly added ``seq_id`` the cached prefix of ``token_ids``; returns the
        number of tokens it need not prefill (a multiple of ``block_size``; 0 on a miss)."""
        blocks = self.match(token_ids)
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

    def release(self, seq_id) -> None:
        """Drop ``seq_id``'s references (before its row is freed); unreferenced blocks become
        evictable, its last block first."""
        for block in reversed(self.seq_blocks.pop(seq_id, [])):
            block.refs -= 1
            if block.refs == 0:
                if block.stale:
                    self._free(block)
                else:
                    self.idle[block.hash] = block

    # ------------------------------------------------------------------ eviction
    @property
    def idle_bytes(self) -> int:
        """Bytes of cached blocks no sequence references (evictable)."""
        return len(self.idle) * self._block_cost

    @property
    def cached_bytes(self) -> int:
        """Bytes of every cached block, referenced or not (stale ones still referenced included)."""
        return len({id(b) for bl in self.seq_blocks.values() for b in bl} | {id(b) for b in self.table.values()}) \
            * self._block_cost

    def evict(self, num_pages: int) -> int:
        """Free least recently used unreferenced blocks until ``num_pages`` HIGH pages are free
        (or none is left); returns the pages freed."""
        freed = 0
        while freed < num_pages and self.idle:
            _, block = self.idle.popitem(last=False)
            del self.table[block.hash]
            self._free(block)
            freed += block.pages.numel()
        return freed

    def _free(self, block: CachedBlock) -> None:
        self.blocks.free_pages[Precision.HIGH].extend(block.pages.tolist())
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
        rows_bytes = sum(int(b.row_bytes[r]) - int(b.shared_pages[r]) * self._block_cost for r in b.rows.values())
        assert b.bytes_used == rows_bytes + len(live) * self._block_cost, "bytes_used"
        for p in b.free_pages:
            held = [int(x) for r in b.rows.values() for lay in range(b.num_layers)
                    for x in b.block_table[p][r, lay, int(b.shared_pages[r]) if p == Precision.HIGH else 0:
                                              int(b.num_pages[p][r, lay])]]
            if p == Precision.HIGH:
                held += [int(x) for blk in live.values() for x in blk.pages]
            assert len(set(held)) == len(held), f"{p.name}: a page held twice"
            assert not set(held) & set(b.free_pages[p]), f"{p.name}: a held page is free"
            assert len(set(b.free_pages[p])) == len(b.free_pages[p]), f"{p.name}: a page freed twice"
            assert len(held) + len(b.free_pages[p]) == b.capacities[p] - 1, f"{p.name}: a page leaked"
