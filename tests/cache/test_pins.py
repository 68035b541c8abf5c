"""Pinned prefixes (prefixkv/cache/pins.py): kept through floods, bounded, per tenant, released."""

import pytest

from prefixkv.cache import POLICIES, BlockRemoved, KVCacheManager, PinError
from prefixkv.request import Request

from .conftest import cached_ids, prefill


def toks(n, start=1):
    return list(range(start, start + n))


def run(mgr, req):
    assert prefill(mgr, req) is not None
    mgr.free(req)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_pinned_system_prompt_survives_a_flood_that_evicts_everything_else(policy):
    mgr = KVCacheManager(num_blocks=12, block_size=4, eviction_policy=policy)
    system = toks(8)  # two blocks
    run(mgr, Request("sys", system + [900]))
    pin = mgr.pin(Request("p", system))
    assert pin.num_tokens == 8 and mgr.pins.num_pinned_blocks == 2
    pinned_ids = {b.block_id for b in pin.blocks}
    run(mgr, Request("other", toks(8, 500) + [901]))
    for i in range(40):  # unique prompts, each filling most of the pool
        run(mgr, Request(f"flood{i}", toks(37, 1000 + 100 * i)))
    assert pinned_ids <= cached_ids(mgr)
    assert mgr.get_computed_blocks(Request("other-again", toks(8, 500) + [901]))[1] == 0  # evicted
    hits, n = mgr.get_computed_blocks(Request("q", system + [902]))
    assert n == 8 and {b.block_id for b in hits} == pinned_ids
    assert mgr.unpin(Request("u", system)) is not None
    assert mgr.num_free_blocks == mgr.num_blocks  # every block free again
    run(mgr, Request("whole-pool", toks(45, 9000)))  # twelve blocks: every one reused
    assert mgr.get_computed_blocks(Request("q2", system + [903]))[1] == 0  # unpinned: evicted like any other


def test_pinning_twice_is_one_pin_and_unpin_releases_it():
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    run(mgr, Request("a", toks(9)))
    first = mgr.pin(Request("p1", toks(9)))
    assert mgr.pin(Request("p2", toks(8))) is first  # the same two full blocks
    assert len(mgr.pins) == 1 and all(b.ref_cnt == 1 for b in first.blocks)
    assert mgr.unpin(Request("u", toks(8))) is first
    assert mgr.unpin(Request("u2", toks(8))) is None
    assert all(b.ref_cnt == 0 for b in first.blocks) and mgr.num_free_blocks == 10


def test_a_shorter_pin_inside_a_longer_one_holds_its_blocks_until_both_go():
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    run(mgr, Request("a", toks(13)))
    long_pin = mgr.pin(Request("p", toks(12)))
    short_pin = mgr.pin(Request("q", toks(4)))
    assert mgr.pins.num_pinned_blocks == 3 and short_pin.blocks[0].ref_cnt == 2
    mgr.unpin(Request("u", toks(12)))
    assert long_pin.blocks[0].ref_cnt == 1 and long_pin.blocks[1].ref_cnt == 0
    mgr.unpin(Request("v", toks(4)))
    assert mgr.num_free_blocks == 10


def test_a_tenant_cannot_pin_or_unpin_another_tenants_prefix():
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    run(mgr, Request("a", toks(9), cache_salt="alice"))
    with pytest.raises(PinError, match="compute it before pinning"):
        mgr.pin(Request("b", toks(9), cache_salt="bob"))  # bob's identity of the same text: not cached
    with pytest.raises(PinError):
        mgr.pin(Request("n", toks(9)))  # nor without a salt
    pin = mgr.pin(Request("a2", toks(9), cache_salt="alice"))
    assert pin.cache_salt == "alice"
    assert mgr.unpin(Request("b2", toks(9), cache_salt="bob")) is None
    assert mgr.unpin_all(cache_salt="bob", every_tenant=False) == 0
    assert len(mgr.pins) == 1
    assert mgr.unpin_all(cache_salt="alice", every_tenant=False) == 1
    assert mgr.num_free_blocks == 10


def test_pins_past_the_bound_are_refused_and_change_nothing():
    mgr = KVCacheManager(num_blocks=10, block_size=4, max_pinned_fraction=0.3)  # 3 blocks
    run(mgr, Request("a", toks(9)))
    run(mgr, Request("b", toks(9, 100)))
    mgr.pin(Request("p", toks(8)))
    with pytest.raises(PinError, match="past the bound of 3"):
        mgr.pin(Request("q", toks(8, 100)))
    assert mgr.pins.num_pinned_blocks == 2 and len(mgr.pins) == 1
    mgr.pin(Request("r", toks(4, 100)))  # one block more fits
    assert mgr.pins.num_pinned_blocks == 3
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        KVCacheManager(num_blocks=10, block_size=4, max_pinned_fraction=1.5)
    # never every block: a request must always find room
    assert KVCacheManager(num_blocks=4, block_size=4, max_pinned_fraction=1.0).pins.max_blocks == 3


def test_reset_drops_pins_unless_asked_to_keep_them():
    mgr = KVCacheManager(num_blocks=10, block_size=4, enable_kv_cache_events=True)
    run(mgr, Request("a", toks(9)))
    run(mgr, Request("b", toks(9, 100)))
    pin = mgr.pin(Request("p", toks(8)))
    mgr.take_events()
    assert mgr.reset_prefix_cache(keep_pinned=True)
    assert cached_ids(mgr) == {b.block_id for b in pin.blocks}
    removed = [e for e in mgr.take_events() if isinstance(e, BlockRemoved)]
    assert len(removed) == 2  # the unpinned blocks only; no AllBlocksCleared
    assert mgr.get_computed_blocks(Request("q", toks(9)))[1] == 8
    busy = Request("busy", toks(9, 300))
    prefill(mgr, busy)
    assert not mgr.reset_prefix_cache() and not mgr.reset_prefix_cache(keep_pinned=True)
    assert len(mgr.pins) == 1  # a refused reset keeps the pins
    mgr.free(busy)
    assert mgr.reset_prefix_cache()
    assert len(mgr.pins) == 0 and cached_ids(mgr) == set() and mgr.num_free_blocks == 10


def test_nothing_cached_cannot_be_pinned_and_caching_off_pins_nothing():
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    with pytest.raises(PinError):
        mgr.pin(Request("p", toks(3)))  # shorter than a block
    off = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    run(off, Request("a", toks(9)))
    with pytest.raises(PinError):
        off.pin(Request("p", toks(9)))
