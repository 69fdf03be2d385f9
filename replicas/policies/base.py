"""Shared machinery of score-based eviction policies (kvpress's ``ScorerPress`` pattern).

A policy scores every kept token of every layer (higher = keep); after prefill and after each
decode step, each layer keeps its highest-scoring tokens within its share of the total budget.

Budget (see ``docs`` and design section 6): a sequence of ``n`` tokens may hold at most
``floor(b * L * ceil(n / block_size))`` pages over its ``L`` layers, i.e. bytes held / bytes full
KV would hold <= b, checked after every step. :meth:`ScoredPolicy.layer_split` splits the pages over
layers (uniformly here; PyramidKV overrides it).

Prefill budget (``prefill_tokens = B``, the KV-size setting of the SnapKV / PyramidKV LongBench
experiments): after prefill each layer keeps ``B`` prompt tokens (on average over layers, for
PyramidKV); each generated token then adds one to every layer's quota (``B + generated``). SnapKV,
PyramidKV, StreamingLLM and recency rank generated tokens first, so they keep them all; H2O and
random choose among all tokens by their own scores. The total budget must be 1.0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from replicas.block_manager import _all   # one Python call, where ndarray.all() makes three
from replicas.kv_cache import KVCache, Precision
from replicas.precision import BITS
from replicas.policy import DecodeView, Evictions, KVAction, KVPolicy, PrefillView
from replicas.sequence import Sequence

KEEP = 1e30  # score of tokens a policy protects (sinks, observation window ...)


def total_pages(budget: float, num_layers: int, num_tokens: int, block_size: int) -> int:
    """Pages a sequence of ``num_tokens`` may hold over all layers at total budget ``budget``."""
    return math.floor(budget * num_layers * math.ceil(num_tokens / block_size) + 1e-9)


def split_evenly(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def cap_and_refill(shares: list[int], cap: int) -> list[int]:
    """Cap every layer's share at ``cap`` units and spread the excess evenly over the layers still
    under it (the remainder to the largest first), so the total is kept while it fits under the
    caps. PyramidKV's first layers can be given more than a short prompt has."""
    out = [min(s, cap) for s in shares]
    excess = sum(shares) - sum(out)
    while excess > 0:   # each round fills a layer or hands out all the excess: at most L rounds
        under = sorted((i for i, s in enumerate(out) if s < cap), key=lambda i: -out[i])
        if not under:
            break
        each, extra = divmod(excess, len(under))
        for rank, i in enumerate(under):
            give = min(cap - out[i], each + (rank < extra))
            out[i] += give
            excess -= give
    return out


def _lowest(scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``[n]`` the position of each row's lowest score in ``scores [n, T]`` over ``positions
    [n, T]``, the lowest position among equal scores (what an argmin in position order picks)."""
    low = scores.min(1, keepdim=True).values
    return torch.where(scores == low, positions, torch.iinfo(positions.dtype).max).min(1).values


def _ranked(scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``positions [n, T]`` of each row reordered lowest score first, the lowest position first
    among equal scores (the order :func:`_lowest` picks from)."""
    by_pos = positions.argsort(-1)
    pos = positions.gather(-1, by_pos)
    return pos.gather(-1, scores.gather(-1, by_pos).sort(dim=-1, stable=True).indices)


def check_prefill_tokens(value) -> None:
    """Raises ValueError unless ``value`` is None or a positive int (a prefill budget in tokens)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"prefill_tokens must be a positive int, got {value!r}")


def attention_probs(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, k_pos: torch.Tensor,
                    chunk: int = 256) -> torch.Tensor:
    """Causal softmax attention of queries over keys, summed over query heads and queries.

    Args:
        q: ``[w, Hq, D]`` queries at positions ``q_pos [w]``; k: ``[n, Hkv, D]`` at ``k_pos [n]``.
    Returns ``[n]`` float32 on the CPU: total attention each key received.
    """
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    q_pos, k_pos = q_pos.to(q.device), k_pos.to(q.device)
    keys = k.float().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)      # [Hq, n, D]
    total = torch.zeros(k.shape[0], dtype=torch.float32)
    for s in range(0, q.shape[0], chunk):
        qc = q[s:s + chunk].float().transpose(0, 1)                             # [Hq, c, D]
        scores = qc @ keys.transpose(1, 2) / math.sqrt(d)                      # [Hq, c, n]
        future = k_pos[None, :] > q_pos[s:s + chunk, None]
        scores = scores.masked_fill(future[None], float("-inf"))
        total += scores.softmax(-1).sum(dim=(0, 1)).cpu()
    return total


@dataclass
class ScoredPolicy(KVPolicy):
    """Keep the top-scoring tokens of each layer within its quota.

    Attributes:
        prefill_tokens: None (default): the quota is the layer's share of the total budget, in
            pages. An int ``B``: prompt tokens each layer keeps (see the module docstring);
            keyword only.

    ``block_size`` (tokens per page) is set by the engine from its KV cache.

    Scores live in one policy-owned tensor (:meth:`scores`, indexed by the cache row, layer and
    position): :meth:`prefill_scores` fills a sequence's prompt after prefill,
    :meth:`decode_scores` gives each new token's for the whole batch, and H2O adds decode
    attention in :meth:`observe_decode_batch`.
    """

    prefill_tokens: int | None = field(default=None, kw_only=True)
    block_size = 16
    _scores: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _scores_np: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _quota: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _quota_key: list | None = field(default=None, init=False, repr=False, compare=False)
    # The ranking of :meth:`_static_victims`: per (row, layer) kept positions, lowest first.
    # NumPy, as the per-step state below: an index operation on a batch's few dozen (row, layer)
    # pairs costs about 1 us in NumPy and 3-10 us in PyTorch.
    _order: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _order_n: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _cursor: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _floor_pos: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _order_key: list | None = field(default=None, init=False, repr=False, compare=False)
    _fresh: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    static_scores = False   # see _static_victims; never with protected_scores overridden

    def __post_init__(self):
        check_prefill_tokens(self.prefill_tokens)

    def layer_split(self, num_layers: int, units: int, unit_tokens: int, generated: int = 0) -> list[int]:
        """Split ``units`` (of ``unit_tokens`` tokens each: pages, or single tokens) over layers;
        ``generated``: tokens of the sequence past its prompt, which every layer keeps alike
        (unused here: the split is uniform)."""
        return split_evenly(units, num_layers)

    def layer_quotas(self, seq: Sequence, num_layers: int, budget: float, num_tokens: int) -> list[int]:
        """Tokens each layer may keep when the sequence has ``num_tokens`` tokens. No layer is
        given more than there is to keep (see :func:`cap_and_refill`)."""
        if self.prefill_tokens is None:
            pages = total_pages(budget, num_layers, num_tokens, self.block_size)
            generated = max(0, num_tokens - len(seq.prompt_token_ids))
            split = self.layer_split(num_layers, pages, self.block_size, generated)
            split = cap_and_refill(split, math.ceil(num_tokens / self.block_size))
            return [p * self.block_size for p in split]
        num_prompt = min(len(seq.prompt_token_ids), num_tokens)
        split = cap_and_refill(self.layer_split(num_layers, self.prefill_tokens * num_layers, 1), num_prompt)
        return [b + num_tokens - num_prompt for b in split]

    @property
    def prompt_only(self) -> bool:
        """True with ``prefill_tokens``: the engine then holds the request at budget 1.0 (a lower
        replica budget would only make it release the oldest pages)."""
        return self.prefill_tokens is not None

    def min_tokens_per_layer(self) -> int:
        """Tokens every layer must be able to keep (e.g. attention sinks)."""
        return 1

    def check(self, num_prompt_tokens: int, budget: float, kv: KVCache) -> None:
        cfg = kv.cfg
        self.block_size = cfg.block_size
        if self.prefill_tokens is not None:
            if budget < 1.0:
                raise ValueError(f"policy {self.name!r} with prefill_tokens compresses the prompt only and "
                                 f"keeps generated tokens: use kv_budget 1.0 (got {budget})")
            fewest = min(self.layer_split(cfg.num_layers, self.prefill_tokens * cfg.num_layers, 1))
            if fewest < min(self.min_tokens_per_layer(), num_prompt_tokens):
                raise ValueError(f"policy {self.name!r} needs {self.min_tokens_per_layer()} tokens per layer, but "
                                 f"prefill_tokens {self.prefill_tokens} leaves {fewest} in some layer")
            return
        pages = total_pages(budget, cfg.num_layers, num_prompt_tokens, cfg.block_size)
        fewest = min(self.layer_split(cfg.num_layers, pages, cfg.block_size)) * cfg.block_size
        if fewest < self.min_tokens_per_layer():
            raise ValueError(f"policy {self.name!r} needs {self.min_tokens_per_layer()} tokens per layer, but a "
                             f"budget of {budget} on a {num_prompt_tokens}-token prompt leaves {fewest} "
                             f"in some layer ({pages} pages of {cfg.block_size} tokens over {cfg.num_layers} layers)")

    def prefill_scores(self, view: PrefillView, layer: int, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # -------------------------------------------------------------- score storage
    def scores(self, kv: KVCache) -> torch.Tensor:
        """``[rows, L, max_model_len]`` float32 score of every (sequence row, layer, position);
        -inf where nothing was scored. Allocated for the cache's shape on first use."""
        cfg = kv.cfg
        shape = (cfg.max_num_seqs, cfg.num_layers, cfg.max_model_len)
        if self._scores is None or tuple(self._scores.shape) != shape:
            self._scores = torch.full(shape, float("-inf"))
            self._scores_np = self._scores.numpy()   # the same memory, for the per-step paths
        return self._scores

    # -------------------------------------------------------------- hooks of the engine
    def on_prefill(self, view: PrefillView) -> list[KVAction]:
        n = view.num_prefilled
        positions = torch.arange(n)
        table, row = self.scores(view.kv), view.kv.row(view.seq.request_id)
        table[row] = float("-inf")
        self._forget_ranking(row)
        for layer in range(view.kv.cfg.num_layers):
            table[row, layer, :n] = self.prefill_scores(view, layer, positions).float().cpu()
        return self.fit(view.seq, view.kv, view.budget, n)

    def on_prefill_chunk(self, view: PrefillView) -> list[KVAction]:
        """For a policy whose prompt scores depend on positions only (``compresses_chunks``): score
        the ``view.num_prefilled`` tokens in the cache and keep each layer's quota *for the whole
        prompt*. The top-q of a union is the top-q of (top-q of the first part, the rest), so the
        entries kept after the last chunk are those a whole-prompt :meth:`on_prefill` keeps; later
        chunks attend to what is kept (as the paper's streaming attention does), not to all
        earlier prompt tokens."""
        n = view.num_prefilled
        table, row = self.scores(view.kv), view.kv.row(view.seq.request_id)
        self._forget_ranking(row)
        positions = torch.arange(n)
        for layer in range(view.kv.cfg.num_layers):
            table[row, layer, :n] = self.prefill_scores(view, layer, positions).float().cpu()
        return self.fit(view.seq, view.kv, view.budget, view.seq.num_tokens)

    def _forget_ranking(self, row: int) -> None:
        """A row's scores were written anew (a prompt, or a recomputed one): rank it again."""
        if self._order_key is not None:
            self._order_key[row] = None

    def decode_scores(self, seqs: list[Sequence], positions: torch.Tensor, num_layers: int) -> torch.Tensor:
        """``[B, L]`` score of each sequence's new token (at ``positions [B]``) in every layer;
        default: recency (its position), below protected tokens."""
        return torch.from_numpy(positions.numpy().astype(np.float32)[:, None].repeat(num_layers, axis=1))

    def observe_decode_batch(self, seqs: list[Sequence], kv: KVCache, rows: torch.Tensor,
                             positions: torch.Tensor, queries: dict[int, torch.Tensor]) -> None:
        """Hook for policies that update scores from decode attention (H2O)."""

    def protected_scores(self, scores: torch.Tensor, positions: torch.Tensor, num_tokens: torch.Tensor,
                         quotas: torch.Tensor) -> torch.Tensor:
        """``scores [n, T]`` over positions ``[T]`` or ``[n, T]`` of n (sequence, layer) pairs whose sequences
        hold ``num_tokens [n]`` tokens under ``quotas [n]``, with protected tokens lifted above
        every scored one (default: unchanged; H2O protects a recent window)."""
        return scores

    def decode_evictions(self, seqs, kv, rows, queries, positions=None):
        """After each decode step: the new token's score, then in every layer over its quota the
        lowest-scoring kept tokens (the new one included) are released, for the whole batch in
        one ``argmin``. The papers evict per token too (H2O Algorithm 1, StreamingLLM's rolling
        window); doing it per step keeps their decisions exactly, and it costs one batched
        swap-remove: the new token moves into the hole the released entry leaves, so no page is
        opened or emptied except when a layer's quota grows. With ``static_scores`` the victims
        come from an order ranked once (:meth:`_static_victims`), the same ones."""
        L = kv.cfg.num_layers
        if positions is None:
            positions = torch.tensor([s.num_tokens - 1 for s in seqs], dtype=torch.int64)
        table = self.scores(kv)
        rows_n, pos_n = rows.numpy(), positions.numpy()
        self._scores_np[rows_n, :, pos_n] = self.decode_scores(seqs, positions, L).numpy()   # [B, L]
        self.observe_decode_batch(seqs, kv, rows, positions, queries)
        quotas = self._decode_quotas(seqs, kv, rows_n, pos_n)                         # [B, L]
        over = kv.blocks.kept_counts(rows).numpy() - quotas
        bi, li = (over > 0).nonzero()   # (ndarray methods: one Python call each, np.* wrappers more)
        if not bi.size:
            return None
        t = torch.from_numpy
        r, single, nxt, q = t(rows_n[bi]), over[bi, li] == 1, t(pos_n[bi] + 1), t(quotas[bi, li])
        ids = [(row, seq.request_id) for row, seq in zip(rows_n.tolist(), seqs)] if self.static_scores else None
        li = t(li)
        if _all(single):
            return Evictions(r, li, self._lowest_kept(kv, table, r, li, nxt, q, ids), ())
        over, bi, single = t(over), t(bi), t(single)
        one = single.nonzero().flatten()
        drop = self._lowest_kept(kv, table, r[one], li[one], nxt[one], q[one], ids) if one.numel() \
            else torch.empty(0, dtype=torch.int64)
        # Several at once: only after the budget fell.
        many = (~single).nonzero().flatten()
        s, pos = self._kept_scores(kv, table, r[many], li[many], nxt[many], q[many])
        actions = []
        order = _ranked(s, pos)
        for j, i in enumerate(many.tolist()):
            d = int(over[bi[i], li[i]])
            actions.append((seqs[int(bi[i])], KVAction(int(li[i]), tuple(order[j, :d].tolist()),
                                                       Precision.RELEASED)))
            if self._order_key is not None:
                self._order_key[int(r[i])] = None     # ranked again at its next eviction
        return Evictions(r[single], li[single], drop, tuple(actions))

    def _lowest_kept(self, kv, table, r, li, num_tokens, quotas, ids):
        """``[m]`` the lowest-scoring kept position of each pair (rows ``r``, layers ``li``, ``[m]``
        each; ties: the lowest position)."""
        if self.static_scores:
            return self._static_victims(kv, table, r, li, num_tokens, ids)
        s, pos = self._kept_scores(kv, table, r, li, num_tokens, quotas)
        return _lowest(s, pos)

    def _kept_scores(self, kv, table, r, li, num_tokens, quotas):
        """``(scores, positions)``, each ``[m, width]``, of the kept entries of the pairs (rows
        ``r [m]``, layers ``li [m]``), every pool's slots side by side, padded with +inf scores;
        with ``quotas`` (and ``num_tokens``, ``[m]`` each), as :meth:`protected_scores` lifts them."""
        b, parts, pos_parts, valid = kv.blocks, [], [], []
        for p in BITS:
            n = b.num_slots[p][r, li]                                                 # [m]
            width = int(n.max()) if n.numel() else 0
            if not width:
                continue
            pos = b.slot_position[p][r, li, :width].long()                            # [m, width]
            parts.append(table[r[:, None], li[:, None], pos])
            pos_parts.append(pos)
            valid.append(torch.arange(width)[None, :] < n[:, None])
        if not parts:
            empty = torch.empty(r.shape[0], 0)
            return empty, empty.long()
        cat = lambda xs: xs[0] if len(xs) == 1 else torch.cat(xs, 1)   # noqa: E731
        pos, s = cat(pos_parts), cat(parts)
        if quotas is not None:
            s = self.protected_scores(s, pos, num_tokens, quotas)
        return s.masked_fill(~cat(valid), float("inf")), pos          # slots past the pair's entries

    def _static_victims(self, kv, table, r, li, next_pos, ids):
        """``[m]`` the position each pair (rows ``r``, layers ``li``, ``[m]`` each, one entry over
        its quota) releases, for a policy with ``static_scores``: a kept entry's score never
        changes, and a generated token's is nondecreasing in its position. A row's kept entries
        are ranked once (by score, then position: what :func:`_lowest` picks) and each eviction
        takes the next in its layer. That entry is the lowest while it is still kept and scores at
        most what the first token generated after the ranking scored (every later token scores at
        least that, at a higher position). Where that does not hold (an entry released by another
        path, the ranking used up, another sequence in the row), the row is ranked again.
        ``next_pos [m]``: the position after the pair's sequence's last; ``ids``: ``(row, request
        id)`` of every sequence of the step. Measured: SnapKV@0.33, 2,048-token prompts, batch 8 (docs/engine.md)."""
        cfg = kv.cfg
        if self._cursor is None or self._cursor.shape != (cfg.max_num_seqs, cfg.num_layers):
            self._order = np.zeros((cfg.max_num_seqs, cfg.num_layers, 0), dtype=np.int32)
            self._order_n = np.zeros((cfg.max_num_seqs, cfg.num_layers), dtype=np.int64)
            self._cursor = np.zeros((cfg.max_num_seqs, cfg.num_layers), dtype=np.int64)
            self._floor_pos = np.zeros(cfg.max_num_seqs, dtype=np.int64)
            self._order_key = [None] * cfg.max_num_seqs
            self._fresh = np.zeros(cfg.max_num_seqs, dtype=bool)   # per step: row ranked for its sequence
        keys, width, fresh, scores = self._order_key, self._order.shape[2], self._fresh, self._scores_np
        rn, ln = r.numpy(), li.numpy()
        fresh[[row for row, _ in ids]] = [keys[row] == rid for row, rid in ids]
        c = self._cursor[rn, ln]
        ok = fresh[rn] & (c < self._order_n[rn, ln])
        if width:
            v = self._order[rn, ln, np.minimum(c, width - 1)].astype(np.int64)
            floor = scores[rn, ln, self._floor_pos[rn]]
            ok &= (kv.blocks.views.location[rn, ln, v] >= 0) & (scores[rn, ln, v] <= floor)
        if not _all(ok):
            stale, inv = np.unique(rn[~ok], return_inverse=True)
            nxt = np.empty_like(stale)
            nxt[inv] = next_pos.numpy()[~ok]
            self._rank(kv, table, torch.from_numpy(stale), torch.from_numpy(nxt), ids)
            c = self._cursor[rn, ln]
            v = self._order[rn, ln, c].astype(np.int64)
        self._cursor[rn, ln] = c + 1
        return torch.from_numpy(v)

    def _rank(self, kv, table, rows, next_pos, ids):
        """Rank the kept entries of every layer of ``rows [k]`` (whose next positions are
        ``next_pos [k]``), lowest (score, position) first, for :meth:`_static_victims`."""
        L, n_max = kv.cfg.num_layers, kv.cfg.max_model_len
        rr, ll = rows.repeat_interleave(L), torch.arange(L).repeat(rows.shape[0])
        s, pos = self._kept_scores(kv, table, rr, ll, None, None)
        pos = pos.masked_fill(s == float("inf"), n_max)      # padding last (kept scores are finite)
        ranked = _ranked(s, pos)                                                       # [k * L, W]
        width = ranked.shape[1]
        if width > self._order.shape[2]:
            grown = np.zeros((*self._order.shape[:2], min(max(width, 2 * self._order.shape[2]), n_max)),
                             dtype=np.int32)
            grown[:, :, :self._order.shape[2]] = self._order
            self._order = grown
        rr, ll, rows_n = rr.numpy(), ll.numpy(), rows.numpy()
        self._order[rr, ll, :width] = ranked.clamp(max=n_max - 1).numpy()
        self._order_n[rr, ll] = kv.blocks.kept_counts(rows).numpy().ravel()
        self._cursor[rows_n] = 0
        self._floor_pos[rows_n] = np.minimum(next_pos.numpy(), n_max - 1)
        owner = dict(ids)
        for row in rows.tolist():
            self._order_key[row] = owner[row]

    def _decode_quotas(self, seqs, kv, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """``[B, L]`` int64 tokens each layer may keep now (``rows``, ``positions``: ``[B]``
        int64); a sequence's quotas are recomputed only when they can change (budget mode: its
        page count; prefill-token mode: they grow by one per generated token, from a fixed
        split)."""
        cfg = kv.cfg
        self.block_size = cfg.block_size
        if self._quota is None or self._quota.shape != (cfg.max_num_seqs, cfg.num_layers):
            self._quota = np.zeros((cfg.max_num_seqs, cfg.num_layers), dtype=np.int64)
            self._quota_key = [None] * cfg.max_num_seqs
        budget_mode, bs, keys = self.prefill_tokens is None, cfg.block_size, self._quota_key
        extra = [0] * len(seqs)
        for i, (seq, row, n) in enumerate(zip(seqs, rows.tolist(), (positions + 1).tolist())):
            if budget_mode:
                key = (seq.request_id, seq.kv_budget, -(-n // bs))
            else:
                num_prompt = min(len(seq.prompt_token_ids), n)
                key, extra[i] = (seq.request_id, num_prompt), n - num_prompt
            if keys[row] != key:
                q = self.layer_quotas(seq, cfg.num_layers, seq.kv_budget, n)
                self._quota[row] = np.asarray(q, dtype=np.int64) - extra[i]
                keys[row] = key
        return self._quota[rows] if budget_mode else self._quota[rows] + np.asarray(extra, dtype=np.int64)[:, None]

    def on_decode(self, view: DecodeView) -> list[KVAction]:
        kv, seq = view.kv, view.seq
        seq.kv_budget = view.budget
        rows = torch.tensor([kv.row(seq.request_id)])
        ev = self.decode_evictions([seq], kv, rows, {l: q[None] for l, q in view.queries.items()})
        if ev is None:
            return []
        out = [KVAction(int(l), (int(p),), Precision.RELEASED) for l, p in zip(ev.layers, ev.positions)]
        return out + [a for _, a in ev.actions]

    def fit(self, seq: Sequence, kv: KVCache, budget: float, num_tokens: int) -> list[KVAction]:
        """Release, in every layer, the lowest-scoring tokens above the layer's quota."""
        cfg = kv.cfg
        self.block_size = cfg.block_size
        table, row = self.scores(kv), kv.row(seq.request_id)
        actions = []
        for layer, quota in enumerate(self.layer_quotas(seq, cfg.num_layers, budget, num_tokens)):
            pos = kv.kept_positions(seq.request_id, layer)
            if len(pos) <= quota:
                continue
            s = self.protected_scores(table[row, layer][pos][None], pos, torch.tensor([num_tokens]),
                                      torch.tensor([quota]))[0]
            drop = torch.topk(-s, len(pos) - quota).indices
            actions.append(KVAction(layer, tuple(pos[drop].tolist()), Precision.RELEASED))
        return actions
