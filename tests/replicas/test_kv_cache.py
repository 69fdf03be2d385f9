"""KV cache: storage per (sequence, layer, token), precision changes, exact byte accounting."""

import math

import pytest
import torch

from replicas.kv_cache import KVCache, KVCacheConfig, KVCacheOutOfMemory, Precision


def cache(**kw):
    cfg = dict(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, max_bytes=1 << 22)
    cfg.update(kw)
    return KVCache(KVCacheConfig(**cfg))


def fill(c, seq, n, layer=None, start=0):
    k, v = torch.randn(n, 2, 8), torch.randn(n, 2, 8)
    for layer_i in ([layer] if layer is not None else range(c.cfg.num_layers)):
        c.append(seq, layer_i, range(start, start + n), k, v)
    return k, v


def test_append_gather_exact_and_bytes_equal_full_kv():
    c = cache()
    c.add_sequence("a")
    k, v = fill(c, "a", 11)
    pos, gk, gv = c.gather("a", 1)
    assert pos.tolist() == list(range(11))
    assert torch.equal(gk, k) and torch.equal(gv, v)
    # 2 layers x ceil(11 / 4) pages, each: 4 slots x (2 x 2 heads x 8 dims x 4 B + 4 B position) + 4 B table entry
    page = 4 * (2 * 2 * 8 * 4 + 4) + 4
    assert c.sequence_bytes("a") == c.bytes_used == c.full_kv_bytes(11) == 2 * 3 * page
    c.free_sequence("a")
    assert c.bytes_used == 0


@pytest.mark.parametrize("precision,bits", [(Precision.INT8, 8), (Precision.INT4, 4)])
def test_demote_keeps_positions_and_bounded_error(precision, bits):
    c = cache()
    c.add_sequence("a")
    k, v = fill(c, "a", 9)
    freed = c.set_precision("a", 0, [1, 4, 8], precision)
    assert c.kept("a", 0) == {p: (precision if p in (1, 4, 8) else Precision.HIGH) for p in range(9)}
    pos, gk, _ = c.gather("a", 0)
    order = pos.argsort()
    step = k.abs().amax(-1, keepdim=True) / (127 if bits == 8 else 7)
    assert ((gk[order] - k).abs() <= step * 0.51 + 1e-6).all()
    low_page = 4 * (2 * 2 * (8 if bits == 8 else 4) + 2 * 2 * 4 + 4) + 4
    high_page = 4 * (2 * 2 * 8 * 4 + 4) + 4
    assert freed == high_page - low_page  # HIGH 9 -> 6 entries frees a page; the LOW entries take one
    assert c.bytes_used == sum(c.sequence_bytes(s) for s in c.seqs)


def test_set_precision_over_several_layers_equals_one_call_per_layer():
    """One call over a layer group (as PASK demotes) leaves every layer with the entries,
    precisions, values and bytes that one call per layer leaves; entries already at or below the
    target in a layer stay as they are."""
    torch.manual_seed(1)
    caches = [cache(num_layers=3), cache(num_layers=3)]
    for c in caches:
        c.add_sequence("a")
    k, v = torch.randn(14, 2, 8), torch.randn(14, 2, 8)
    for c in caches:
        for layer in range(3):
            c.append("a", layer, range(14), k, v)
        c.set_precision("a", 1, [2, 5], Precision.INT4)          # below the target in layer 1
        c.set_precision("a", 2, [3], Precision.RELEASED)
    cells = [0, 2, 3, 5, 6, 7, 8, 9, 13]
    one, per_layer = caches
    freed = one.set_precision("a", range(3), cells, Precision.INT8)
    freed_each = sum(per_layer.set_precision("a", layer, cells, Precision.INT8) for layer in range(3))
    assert freed == freed_each and one.bytes_used == per_layer.bytes_used
    for layer in range(3):
        assert one.kept("a", layer) == per_layer.kept("a", layer)
        got, want = one.gather("a", layer), per_layer.gather("a", layer)
        order_g, order_w = got[0].argsort(), want[0].argsort()
        for g, w in zip(got[1:], want[1:]):
            assert torch.equal(g[order_g], w[order_w])
    assert one.kept("a", 1)[2] == Precision.INT4 and 3 not in one.kept("a", 2)
    recount(one, ["a"])


def test_demotion_counts_the_pages_it_frees_and_is_all_or_nothing():
    """A demotion in a full pool succeeds when the pages it frees pay for its LOW pages (it
    releases before it stores); when they cannot, it raises and nothing changes."""
    high = 4 * (2 * 2 * 8 * 4 + 4) + 4
    c = cache(max_bytes=4 * high)
    c.add_sequence("a")
    fill(c, "a", 16, layer=0)                                    # the whole budget: 4 HIGH pages
    assert c.bytes_free == 0
    c.set_precision("a", 0, range(8), Precision.INT8)           # frees 2 HIGH pages, takes 2 INT8
    assert c.kept("a", 0) == {p: Precision.INT8 if p < 8 else Precision.HIGH for p in range(16)}
    recount(c, ["a"])
    d = cache(max_bytes=4 * high)
    d.add_sequence("a")
    fill(d, "a", 16, layer=0)
    before = (d.kept("a", 0), d.bytes_used)
    with pytest.raises(KVCacheOutOfMemory):
        d.set_precision("a", 0, [0], Precision.INT8)            # frees nothing, needs an INT8 page
    assert (d.kept("a", 0), d.bytes_used) == before
    recount(d, ["a"])


def test_release_frees_pages_and_tokens_never_return():
    c = cache()
    c.add_sequence("a")
    fill(c, "a", 12)
    before = c.sequence_bytes("a")
    c.set_precision("a", 0, range(0, 8), Precision.RELEASED)
    assert sorted(c.kept("a", 0)) == list(range(8, 12))
    assert c.sequence_bytes("a") == before - 2 * (4 * (2 * 2 * 8 * 4 + 4) + 4)
    assert c.set_precision("a", 0, [0, 1], Precision.HIGH) == 0  # precision never rises
    assert 0 not in c.kept("a", 0)
    with pytest.raises(ValueError, match="positions must be new"):
        fill(c, "a", 1, layer=0, start=3)


def test_truncate_takes_back_a_draft_at_every_precision():
    """A jump-forward draft stored at mixed precisions (one token released) and taken back from
    its second token: the cache holds what it held before the rejected tokens (entries, bytes,
    values), and the rejected positions can be stored again."""
    c = cache()
    c.add_sequence("a")
    k, v = fill(c, "a", 6)
    held = [c.kept("a", layer) for layer in range(2)]
    before = c.sequence_bytes("a")
    targets = torch.tensor([Precision.HIGH, Precision.INT8, Precision.RELEASED, Precision.INT4, Precision.INT8])
    for layer in range(2):
        c.append("a", layer, range(6, 11), torch.randn(5, 2, 8), torch.randn(5, 2, 8), targets)
    assert c.sequence_bytes("a") > before
    c.truncate("a", 7)                       # keeps the draft's first token (position 6)
    for layer in range(2):
        assert c.kept("a", layer) == {**held[layer], 6: Precision.HIGH}
    c.truncate("a", 6)
    assert [c.kept("a", layer) for layer in range(2)] == held and c.sequence_bytes("a") == before
    pos, gk, gv = c.gather("a", 1)
    assert pos.tolist() == list(range(6)) and torch.equal(gk, k) and torch.equal(gv, v)
    fill(c, "a", 2, start=6)                 # the positions are new again
    assert sorted(c.kept("a", 0)) == list(range(8))
    assert c.bytes_used == sum(c.sequence_bytes(s) for s in c.seqs)


def test_new_tokens_keep_true_positions_after_release():
    c = cache()
    c.add_sequence("a")
    fill(c, "a", 10, layer=0)
    c.set_precision("a", 0, [0, 2, 5, 6], Precision.RELEASED)
    fill(c, "a", 1, layer=0, start=10)
    pos, _, _ = c.gather("a", 0)
    assert sorted(pos.tolist()) == [1, 3, 4, 7, 8, 9, 10]
    b, row = c.blocks, c.row("a")
    assert len(c.page_ids("a", 0, Precision.HIGH)) == 2
    assert sorted(b.slot_position[Precision.HIGH][row, 0, :7].tolist()) == [1, 3, 4, 7, 8, 9, 10]


def test_decode_attention_over_mixed_pools_equals_dense():
    torch.manual_seed(0)
    c = cache()
    for s in ("a", "b"):
        c.add_sequence(s)
    fill(c, "a", 13)
    fill(c, "b", 6)
    c.set_precision("a", 1, [0, 3, 7], Precision.INT8)
    c.set_precision("a", 1, [5, 9], Precision.INT4)
    c.set_precision("a", 1, [11], Precision.RELEASED)
    c.set_precision("b", 1, [2], Precision.INT4)
    q = torch.randn(2, 4, 8)
    got = c.decode_attention(["a", "b"], 1, q)
    for i, s in enumerate(("a", "b")):
        _, k, v = c.gather(s, 1)
        k, v = k.repeat_interleave(2, 1).double(), v.repeat_interleave(2, 1).double()
        w = (torch.einsum("hd,thd->ht", q[i].double(), k) / math.sqrt(8)).softmax(-1)
        torch.testing.assert_close(got[i].double(), torch.einsum("ht,thd->hd", w, v), atol=1e-5, rtol=1e-5)


def test_out_of_memory_leaves_state_unchanged():
    page = 4 * (2 * 2 * 8 * 4 + 4) + 4
    c = cache(max_bytes=3 * page)
    c.add_sequence("a")
    fill(c, "a", 8, layer=0)
    with pytest.raises(KVCacheOutOfMemory, match="budget exhausted"):
        fill(c, "a", 8, layer=1)
    assert c.bytes_used == 2 * page and c.num_kept("a", 1) == 0


def test_bad_shapes():
    c = cache()
    c.add_sequence("a")
    with pytest.raises(ValueError, match="k, v must be"):
        c.append("a", 0, [0, 1], torch.zeros(2, 3, 8), torch.zeros(2, 3, 8))
    with pytest.raises(ValueError, match="already has"):
        c.add_sequence("a")


def test_append_decode_equals_per_sequence_appends_and_is_all_or_nothing():
    torch.manual_seed(0)
    a, b = cache(), cache()
    for c in (a, b):
        for s in ("x", "y", "z"):
            c.add_sequence(s)
    for c in (a, b):
        torch.manual_seed(1)
        fill(c, "x", 7, layer=0)
        fill(c, "y", 4, layer=0)  # the next token opens a new page
        fill(c, "z", 1, layer=0)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    a.append_decode(["x", "y", "z"], 0, [7, 9, 1], k, v)  # positions need only increase
    for i, (s, p) in enumerate((("x", 7), ("y", 9), ("z", 1))):
        b.append(s, 0, [p], k[i:i + 1], v[i:i + 1])
    for s in ("x", "y", "z"):
        ga, gb = a.gather(s, 0), b.gather(s, 0)
        assert all(torch.equal(t, u) for t, u in zip(ga, gb))
    assert a.bytes_used == b.bytes_used
    q = torch.randn(3, 4, 8)
    torch.testing.assert_close(a.decode_attention(["x", "y", "z"], 0, q), b.decode_attention(["x", "y", "z"], 0, q))
    with pytest.raises(ValueError, match="positions must be new"):
        a.append_decode(["x", "y"], 0, [8, 9], k[:2], v[:2])
    assert a.num_kept("x", 0) == 8  # the refused batch wrote nothing, not even x's token
    page = 4 * (2 * 2 * 8 * 4 + 4) + 4
    tight = cache(max_bytes=2 * page)
    for s in ("x", "y"):
        tight.add_sequence(s)
        fill(tight, s, 4, layer=0)  # both pages full: the next token of each needs a page
    with pytest.raises(KVCacheOutOfMemory):
        tight.append_decode(["x", "y"], 0, [4, 4], k[:2], v[:2])
    assert tight.num_kept("x", 0) == tight.num_kept("y", 0) == 4 and tight.bytes_used == 2 * page


def pages_bytes(c, seq):
    """A sequence's bytes recounted from its page lists."""
    return sum(len(c.page_ids(seq, layer, p)) * c.page_cost(p) for layer in range(c.cfg.num_layers)
               for p in (Precision.HIGH, Precision.INT8, Precision.INT4))


def test_byte_counters_match_pages_under_random_operations():
    """Appends, decode appends, demotions, releases and frees in random order: the per-sequence
    counters always equal the pages held, and a decode append never takes more bytes than
    ``next_token_bytes`` promised the scheduler."""
    rng = torch.Generator().manual_seed(3)
    c = cache(max_bytes=1 << 24)
    live, nxt, made = [], {}, 0
    for step in range(300):
        op = int(torch.randint(0, 5, (1,), generator=rng))
        if op == 0 or not live:
            made += 1
            sid = f"s{made}"
            c.add_sequence(sid)
            n = int(torch.randint(1, 12, (1,), generator=rng))
            fill(c, sid, n)
            live.append(sid)
            nxt[sid] = n
        elif op == 1:
            promised = sum(c.next_token_bytes(s) for s in live)
            before = c.bytes_used
            k, v = torch.randn(len(live), 2, 8), torch.randn(len(live), 2, 8)
            for layer in range(c.cfg.num_layers):
                c.append_decode(live, layer, [nxt[s] for s in live], k, v)
            assert c.bytes_used - before <= promised
            for s in live:
                nxt[s] += 1
        elif op in (2, 3):
            sid = live[int(torch.randint(0, len(live), (1,), generator=rng))]
            layer = int(torch.randint(0, c.cfg.num_layers, (1,), generator=rng))
            kept = sorted(c.kept(sid, layer))
            chosen = [p for p in kept if torch.rand(1, generator=rng) < 0.4]
            c.set_precision(sid, layer, chosen, Precision.RELEASED if op == 3 else Precision.INT8)
        else:
            c.free_sequence(live.pop(int(torch.randint(0, len(live), (1,), generator=rng))))
        for s in live:
            assert c.sequence_bytes(s) == pages_bytes(c, s), (step, s)
        assert c.bytes_used == sum(c.sequence_bytes(s) for s in live)


def recount(c, live):
    """Check the block manager against a recount: pages disjoint and not free, slots dense,
    positions and locations agree, bytes equal pages held."""
    b, owned = c.blocks, []
    for s in live:
        row = c.row(s)
        assert int(b.row_bytes[row]) == b.pages_held(row) == pages_bytes(c, s)
        for layer in range(c.cfg.num_layers):
            for p in (Precision.HIGH, Precision.INT8, Precision.INT4):
                pages, n = c.page_ids(s, layer, p), int(b.num_slots[p][row, layer])
                assert len(pages) == -(-n // c.cfg.block_size)
                owned += [(p, i) for i in pages]
                pos = b.slot_position[p][row, layer, :n].long()
                assert (b.location[row, layer, pos] == (torch.arange(n, dtype=torch.int32) << 2 | int(p))).all()
            kept = (b.location[row, layer] >= 0).sum()
            assert int(kept) == c.num_kept(s, layer)
    assert len(owned) == len(set(owned)) and all(i != 0 for _, i in owned)   # page 0: the trash page
    for p in (Precision.HIGH, Precision.INT8, Precision.INT4):
        free = b.free_pages[p]
        assert len(free) == len(set(free)) and not {i for q, i in owned if q == p} & set(free)
    assert c.bytes_used == sum(c.sequence_bytes(s) for s in live)


def test_plan_and_block_tables_against_a_recount_under_random_operations():
    """Decode plans with random per-layer targets, batched releases, demotions, per-layer appends
    and frees (as preemption does) in random order: after each, the block tables, slot positions
    and bytes match a recount, every kept entry holds the data written for its position (HIGH
    exactly), and the plan's tables list each row's pages in slot order."""
    rng = torch.Generator().manual_seed(5)
    c = cache(max_bytes=1 << 24)
    live, data, made = [], {}, 0

    def rand(n):
        return int(torch.randint(0, n, (1,), generator=rng))
    for step in range(300):
        op = rand(5)
        if op == 0 or not live:
            made += 1
            sid = f"s{made}"
            c.add_sequence(sid)
            k, v = fill(c, sid, 1 + rand(12))
            live.append(sid)
            for layer in range(2):
                data.update({(sid, layer, p): k[p] for p in range(k.shape[0])})
        elif op == 1:
            pos = torch.tensor([int(c.blocks.next_position[c.row(s)].max()) for s in live])
            targets = torch.randint(0, 4, (len(live), 2), generator=rng)
            plan = c.plan_decode(live, pos, targets)
            k, v = torch.randn(len(live), 2, 8), torch.randn(len(live), 2, 8)
            for layer in range(2):
                c.store(plan, layer, k, v)
                for i, s in enumerate(live):
                    if targets[i, layer] != 0:
                        data[(s, layer, int(pos[i]))] = k[i]
            for p, table in plan.block_tables.items():
                for i, s in enumerate(live):
                    for layer in range(2):
                        pages = c.page_ids(s, layer, p)
                        assert table[layer, i, :len(pages)].tolist() == pages
        elif op == 2:
            pairs = [(s, layer) for s in live for layer in range(2) if c.num_kept(s, layer)]
            if pairs:
                chosen = pairs[:: 1 + rand(3)]
                pos = [int(c.kept_positions(s, layer)[rand(c.num_kept(s, layer))]) for s, layer in chosen]
                c.release_one(torch.tensor([c.row(s) for s, _ in chosen]), torch.tensor([l for _, l in chosen]),
                              torch.tensor(pos))
        elif op == 3:   # one layer, or both in one call
            s, layers = live[rand(len(live))], [[0], [1], [0, 1]][rand(3)]
            kept = sorted(set().union(*(c.kept_positions(s, layer).tolist() for layer in layers)))
            c.set_precision(s, layers if len(layers) > 1 else layers[0], [p for p in kept if rand(3) == 0],
                            (Precision.RELEASED, Precision.INT8, Precision.INT4)[rand(3)])
        else:
            c.free_sequence(live.pop(rand(len(live))))
        recount(c, live)
        for s in live:
            for layer in range(2):
                pos, gk, _ = c.gather(s, layer)
                kept = c.kept(s, layer)
                assert sorted(pos.tolist()) == sorted(kept)
                for p, key in zip(pos.tolist(), gk):
                    want = data[(s, layer, p)]
                    if kept[p] == Precision.HIGH:
                        assert torch.equal(key, want)
                    else:
                        assert (key - want).abs().max() <= want.abs().max() / (7 if kept[p] == Precision.INT4 else 127) + 1e-5


def test_after_sequences_leave_a_prompt_lies_in_consecutive_pages():
    """After sequences that took pages in an interleaved order are freed in another order, a new
    prompt's pages are consecutive in every layer (the fused attention streams them), and the
    lowest free ids come first."""
    c = cache(num_layers=2, max_num_seqs=4)
    for s in "abc":
        c.add_sequence(s)
    for step in range(12):   # one token per sequence per step: their pages interleave
        for s in "abc":
            fill(c, s, 1, start=step)
    for s in "bca":
        c.free_sequence(s)
    c.add_sequence("d")
    fill(c, "d", 40)
    pages = [c.page_ids("d", l, Precision.HIGH) for l in range(2)]
    assert sorted(pages[0] + pages[1]) == list(range(1, 21))   # the 20 lowest ids, page 0 the trash
    for p in pages:
        assert p == list(range(p[0], p[0] + 10))


def test_pages_a_compression_released_go_to_the_next_prompt_in_order():
    """The pages a prompt's compression releases (a run of consecutive ids) are the next prompt's
    pages in the same ascending order, not reversed, so that prompt too lies in consecutive pages."""
    c = cache(num_layers=1, max_num_seqs=2)
    c.add_sequence("a")
    fill(c, "a", 40)                                  # pages 1 .. 10
    released = c.page_ids("a", 0, Precision.HIGH)[4:]
    c.set_precision("a", 0, list(range(16, 40)), Precision.RELEASED)   # the last 6 pages empty
    c.add_sequence("b")
    fill(c, "b", 24)
    assert c.page_ids("b", 0, Precision.HIGH) == released == list(range(5, 11))
