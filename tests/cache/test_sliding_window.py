"""A hybrid model's KV-cache groups in the manager (prefixkv/cache/sliding_window.py): group 0 keeps
every block, a sliding group releases the blocks out of its window while the request runs, a hit is
the longest prefix every group holds, events name the group, pins hold the window, and every block
is free after."""

import pytest

from prefixkv.cache import BlockRemoved, BlockStored, KVCacheManager
from prefixkv.cache.sliding_window import SlidingWindowGroups
from prefixkv.request import Request

from .conftest import decode, prefill

BS = 4


def toks(n, start=1):
    return list(range(start, start + n))


def hybrid(num_blocks=64, windows=(8,), **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks=num_blocks, block_size=BS, group_windows=windows, **kw)


def live(table):
    return [i for i, b in enumerate(table) if b is not None]


def test_first_needed_block_follows_the_window_rule():
    """A query at p sees keys p - window + 1 .. p: the block of p - window + 1 is the first read."""
    g = SlidingWindowGroups([8, None], BS)
    assert [g.first_needed_block(1, p) for p in (0, 7, 8, 11, 12, 20)] == [0, 0, 0, 1, 1, 3]
    assert g.first_needed_block(2, 1000) == 0  # a full-attention group keeps everything
    with pytest.raises(ValueError, match="at least one token"):
        SlidingWindowGroups([0], BS)


def test_blocks_out_of_the_window_go_back_while_the_request_runs():
    mgr = hybrid()
    req = Request("a", toks(30))
    assert prefill(mgr, req) is not None
    state = mgr._requests["a"]
    # the prefill wrote all 8 positions' blocks in both groups
    assert len(state.blocks) == 8 and live(state.groups[0]) == list(range(8))
    held = mgr.num_blocks - mgr.num_free_blocks
    assert held == 16
    decode(mgr, req, 500)  # computed up to 30: the next query (30) reads 23..30 -> blocks 5..7
    assert live(state.groups[0]) == [5, 6, 7]
    assert mgr.num_blocks - mgr.num_free_blocks == 8 + 3
    assert mgr.get_group_block_ids("a")[0][:5] == [0] * 5  # released entries read as block 0
    for t in range(501, 520):  # decoding on: the sliding group stays at the window's size
        decode(mgr, req, t)
        assert len(live(state.groups[0])) <= 3
    mgr.free(req)
    assert mgr.num_free_blocks == mgr.num_blocks


def test_a_hit_is_the_longest_prefix_every_group_holds():
    mgr = hybrid(windows=(8, None))
    a = Request("a", toks(40))
    prefill(mgr, a)
    mgr.free(a)  # every block cached: group 0 and both later groups
    every, n = mgr.get_computed_blocks(Request("b", toks(40) + [999]))
    assert n == 40
    # evict the sliding group's block 9: a hit ending at 40 reads 33..40 (blocks 8, 9); one ending
    # at 36 reads 29..36 (blocks 7, 8) - so the hit drops to 36
    victim = mgr.block_pool.cached_blocks.get_one_block((every[9].uid, (-1,), None))
    assert victim is not None
    mgr.block_pool.cached_blocks.remove(victim)
    b = Request("b", toks(40) + [999])
    hits, n = mgr.get_computed_blocks(b)
    assert n == 36 and hits == every[:9]
    d = Request("d", toks(40) + [999])
    with pytest.raises(ValueError, match="every KV-cache group"):  # a hit not every group holds
        mgr.allocate_slots(d, 1, every)
    assert "d" not in mgr._requests
    assert mgr.allocate_slots(b, b.num_tokens - n, hits) is not None
    state = mgr._requests["b"]
    assert live(state.groups[0]) == [7, 8, 9, 10]  # the hit's window, then the new blocks
    assert live(state.groups[1]) == list(range(11))  # the full-attention group: every block
    # b's block 9 is full after its step: cached again under the same identity, a hit for others
    assert mgr.get_computed_blocks(Request("e", toks(40) + [999]))[1] == 40
    mgr.free(b)
    assert mgr.num_free_blocks == mgr.num_blocks


def test_events_name_the_group_and_its_window():
    mgr = hybrid(windows=(8,), enable_kv_cache_events=True)
    req = Request("a", toks(17))
    prefill(mgr, req)
    stored = [e for e in mgr.take_events() if isinstance(e, BlockStored)]
    assert [(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in stored] == [
        (0, "full_attention", None),
        (1, "sliding_window", 8),
    ]
    assert stored[0].block_hashes == stored[1].block_hashes  # the same blocks, told apart by group
    mgr.free(req)
    for i in range(20):  # flood: every cached block is reused
        r = Request(f"f{i}", toks(17, 1000 + 100 * i))
        prefill(mgr, r)
        mgr.free(r)
    removed = [e for e in mgr.take_events() if isinstance(e, BlockRemoved)]
    gone = {(h, e.group_idx) for e in removed for h in e.block_hashes}
    assert {(h, g) for h in stored[0].block_hashes for g in (0, 1)} <= gone


def test_a_pin_holds_the_window_at_the_prefix_end():
    mgr = hybrid(num_blocks=24)
    prefill(mgr, Request("a", toks(33)))
    mgr.free(Request("a", toks(33)))
    pin = mgr.pin(Request("p", toks(32)))
    assert len(pin.blocks) == 8 and len(pin.window_blocks) == 2  # positions 25..32 -> blocks 6, 7
    for i in range(30):
        r = Request(f"f{i}", toks(12, 1000 + 100 * i))
        prefill(mgr, r)
        mgr.free(r)
    hits, n = mgr.get_computed_blocks(Request("q", toks(32) + [5]))
    assert n == 32
    assert mgr.unpin(Request("u", toks(32))) is pin
    assert mgr.num_free_blocks == mgr.num_blocks


def test_an_unloaded_adapters_blocks_go_in_every_group():
    mgr = hybrid()
    r = Request("a", toks(20), lora_request="x")
    prefill(mgr, r)
    mgr.free(r)
    evicted, held = mgr.evict_where(lambda extras: any(k[0] == "lora" for k in extras))
    assert (evicted, held) == (5 + 5, 0)
    assert mgr.get_computed_blocks(Request("b", toks(20) + [3], lora_request="x"))[1] == 0


def test_a_block_reused_by_another_group_is_removed_under_that_group():
    """A block freed by one group and reused by another carries the new group: its eviction's
    BlockRemoved names the group whose identity it held."""
    mgr = hybrid(num_blocks=8, windows=(4,), enable_kv_cache_events=True)
    for i in range(8):  # the pool turns over: each reuse takes blocks whichever group last held them
        r = Request(f"r{i}", toks(8 + 4 * (i % 3), 1000 + 100 * i))
        prefill(mgr, r)
        mgr.free(r)
    checked = 0
    for block in mgr.block_pool.blocks:
        if block.content_hash is not None:
            assert block.block_key is not None
            marker = block.block_key[1][0]
            assert block.group_idx == (-marker if marker < 0 else 0), block
            checked += 1
    assert checked == 8
