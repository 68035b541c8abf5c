"""Edge cases of lookup, allocation, freeing and reset."""

import pytest

from prefixkv.cache import POLICIES, KVCacheManager
from prefixkv.lora import LoRARequest
from prefixkv.request import Request

from .conftest import cached_ids, decode, prefill


def toks(n, start=1):
    return list(range(start, start + n))


def test_prompt_shorter_than_a_block_is_never_cached(mgr10):
    r = Request("a", toks(3))
    assert prefill(mgr10, r) == [0]
    assert cached_ids(mgr10) == set()
    mgr10.free(r)
    hits, n = mgr10.get_computed_blocks(Request("b", toks(3)))
    assert hits == [] and n == 0


def test_exact_multiple_of_block_size_recomputes_last_block(mgr10):
    r = Request("a", toks(8))
    prefill(mgr10, r)
    assert cached_ids(mgr10) == {0, 1}
    mgr10.free(r)
    hits, n = mgr10.get_computed_blocks(Request("b", toks(8)))
    assert [b.block_id for b in hits] == [0] and n == 4  # at most 7 of 8 tokens may hit
    hits, n = mgr10.get_computed_blocks(Request("c", toks(9)))
    assert [b.block_id for b in hits] == [0, 1] and n == 8


def test_lookup_stops_at_first_miss(mgr10):
    prefill(mgr10, Request("a", toks(13)))
    changed = toks(13)
    changed[5] = 999  # second block differs; third block is equal but its prefix is not
    hits, n = mgr10.get_computed_blocks(Request("b", changed))
    assert [b.block_id for b in hits] == [0] and n == 4


def test_lookup_changes_nothing(mgr10):
    r = Request("a", toks(13))
    prefill(mgr10, r)
    mgr10.free(r)
    before = (mgr10.block_pool.eviction_policy.block_ids(), [b.ref_cnt for b in mgr10.block_pool.blocks])
    mgr10.get_computed_blocks(Request("b", toks(13)))
    after = (mgr10.block_pool.eviction_policy.block_ids(), [b.ref_cnt for b in mgr10.block_pool.blocks])
    assert before == after


def test_hit_on_running_blocks_shares_them(mgr10):
    a = Request("a", toks(9))
    prefill(mgr10, a)
    b = Request("b", toks(9))
    assert prefill(mgr10, b) == [3]
    assert mgr10.get_block_ids("b")[:2] == [0, 1]
    assert [blk.ref_cnt for blk in mgr10.block_pool.blocks[:3]] == [2, 2, 1]
    mgr10.free(a)
    assert mgr10.block_pool.eviction_policy.block_ids()[-1] == 2  # only a's tail block is free
    mgr10.free(b)
    assert mgr10.num_free_blocks == 10


def test_hit_on_free_queue_blocks_counts_against_capacity():
    mgr = KVCacheManager(num_blocks=4, block_size=4)
    a = Request("a", toks(9))
    prefill(mgr, a)
    mgr.free(a)  # blocks 0,1 cached and free; 3 free blocks needed? no: 4 free in all
    hog = Request("hog", toks(4, start=500))
    prefill(mgr, hog)  # takes block 3 (the head)
    b = Request("b", toks(17))  # hits 0,1 (free), needs 3 more: 5 blocks > 4 in the pool
    hits, n = mgr.get_computed_blocks(b)
    assert n == 8
    assert mgr.allocate_slots(b, 17 - n, hits) is None
    c = Request("c", toks(12))  # hits 0,1, needs 1 more: 2 evictable hits + 1 new = 3 free
    hits, n = mgr.get_computed_blocks(c)
    assert [blk.block_id for blk in mgr.allocate_slots(c, 12 - n, hits)] == [2]


def test_failed_allocation_changes_nothing():
    mgr = KVCacheManager(num_blocks=3, block_size=4)
    a = Request("a", toks(8))
    prefill(mgr, a)
    mgr.free(a)
    snapshot = (
        mgr.block_pool.eviction_policy.block_ids(),
        cached_ids(mgr),
        [b.ref_cnt for b in mgr.block_pool.blocks],
        dict(mgr.block_pool.cached_blocks.items()),
    )
    big = Request("big", toks(20))
    hits, n = mgr.get_computed_blocks(big)
    assert mgr.allocate_slots(big, 20 - n, hits) is None
    assert snapshot == (
        mgr.block_pool.eviction_policy.block_ids(),
        cached_ids(mgr),
        [b.ref_cnt for b in mgr.block_pool.blocks],
        dict(mgr.block_pool.cached_blocks.items()),
    )
    assert mgr.get_block_ids("big") == []


def test_decode_blocks_are_cached_and_hit_by_follow_up_turn(mgr10):
    r = Request("a", toks(6))
    prefill(mgr10, r)
    for t in (50, 51, 52):
        decode(mgr10, r, t)
    mgr10.free(r)
    follow = Request("b", toks(6) + [50, 51, 60, 61, 62])  # prompt + answer + next turn
    hits, n = mgr10.get_computed_blocks(follow)
    assert n == 8  # the block completed by generated tokens is hit


def test_evicting_one_of_two_duplicates_keeps_the_other():
    mgr = KVCacheManager(num_blocks=6, block_size=4)
    r1 = Request("r1", [1, 2, 3, 4, 5, 6])
    prefill(mgr, r1)
    for t in (7, 8, 9):
        decode(mgr, r1, t)
    r2 = Request("r2", [1, 2, 3, 4, 5, 6])
    prefill(mgr, r2)
    for t in (7, 8, 9):
        decode(mgr, r2, t)
    key = mgr.block_pool.blocks[1].block_key
    assert len(mgr.block_pool.cached_blocks.get_blocks(key)) == 2  # blocks 1 and 3: both EFGH
    mgr.free(r2)  # r2 frees 4, 3 then 0 is still held by r1
    mgr.free(r1)
    queue = mgr.block_pool.eviction_policy.block_ids()
    victim_order = [b for b in queue if b in (1, 3)]
    hog = Request("hog", list(range(100, 100 + 4 * (queue.index(victim_order[0]) + 1))))
    prefill(mgr, hog)  # evicts up to and including the first EFGH copy
    assert mgr.block_pool.blocks[victim_order[0]].block_key != key
    assert mgr.block_pool.get_cached_block(key).block_id == victim_order[1]
    hits, n = mgr.get_computed_blocks(Request("again", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert [b.block_id for b in hits] == [0, victim_order[1]] and n == 8


def test_reset_refused_while_busy_then_forgets_everything(mgr10):
    r = Request("a", toks(9))
    prefill(mgr10, r)
    assert mgr10.reset_prefix_cache() is False
    assert cached_ids(mgr10) == {0, 1}
    mgr10.free(r)
    assert mgr10.reset_prefix_cache() is True
    assert cached_ids(mgr10) == set() and len(mgr10.block_pool.cached_blocks) == 0
    assert mgr10.get_computed_blocks(Request("b", toks(9))) == ([], 0)


def test_caching_disabled_never_hits():
    mgr = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    r = Request("a", toks(9))
    prefill(mgr, r)
    assert cached_ids(mgr) == set()
    mgr.free(r)
    assert mgr.get_computed_blocks(Request("b", toks(9))) == ([], 0)
    assert mgr.block_pool.eviction_policy.block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]


def test_stats_count_queries_and_hits(mgr10):
    prefill(mgr10, Request("a", toks(9)))
    prefill(mgr10, Request("b", toks(9)))
    s = mgr10.stats
    assert (s.requests, s.queries, s.hits) == (2, 18, 8)
    assert s.hit_rate == pytest.approx(8 / 18)


def test_usage_counts_held_blocks_only(mgr10):
    r = Request("a", toks(9))
    prefill(mgr10, r)
    assert mgr10.usage == pytest.approx(0.3)
    mgr10.free(r)
    assert mgr10.usage == 0.0


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(num_blocks=0, block_size=4)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=4, block_size=0)
    with pytest.raises(ValueError, match="empty"):
        Request("x", [])
    mgr = KVCacheManager(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="num_new_tokens"):
        mgr.allocate_slots(Request("x", [1]), -1)


def test_lookup_without_recording_leaves_stats_alone(mgr10):
    prefill(mgr10, Request("a", toks(9)))
    mgr10.get_computed_blocks(Request("b", toks(9)), record_stats=False)
    assert (mgr10.stats.requests, mgr10.stats.queries) == (1, 9)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_evict_where_drops_matching_free_blocks_first_keeps_held_ones(policy):
    """Content that can never be hit again (an unloaded adapter's blocks) is evicted first; blocks
    held by a running request keep their identity, since their successors' keys name them."""
    mgr = KVCacheManager(num_blocks=12, block_size=4, eviction_policy=policy, enable_kv_cache_events=True)
    dead_lora = LoRARequest("dead", 1, "/adapter", "digest")  # every block of its requests carries it
    salted = [Request(f"s{i}", list(range(i, i + 9)), lora_request=dead_lora) for i in range(2)]
    plain = Request("p", list(range(100, 109)))
    for req in [*salted, plain]:
        prefill(mgr, req)
    for req in [salted[0], plain]:
        mgr.free(req)
    mgr.take_events()
    dead = {b.block_id for b in mgr.block_pool.blocks if b.block_key and b.block_key[2] and b.ref_cnt == 0}
    assert len(dead) == 2
    evicted, held = mgr.evict_where(lambda extras: ("lora", "dead", "/adapter", "digest") in extras)
    assert (evicted, held) == (2, 2)
    assert set(mgr.block_pool.eviction_policy.block_ids()[:2]) == dead
    assert [type(e).__name__ for e in mgr.take_events()] == ["BlockRemoved", "BlockRemoved"]
    assert {b.block_id for b in mgr.block_pool.get_new_blocks(2)} == dead
    hits, _ = mgr.get_computed_blocks(Request("p2", list(range(100, 109))))
    assert len(hits) == 2  # the plain prefix survived


def test_num_blocks_held_counts_the_block_ids(mgr10):
    r = Request("a", toks(6))
    assert mgr10.num_blocks_held("a") == 0 and mgr10.get_block_ids("a") == []
    prefill(mgr10, r)
    for t in (50, 51, 52):
        decode(mgr10, r, t)
        assert mgr10.num_blocks_held("a") == len(mgr10.get_block_ids("a")) == -(-r.num_tokens // 4)
    mgr10.free(r)
    assert mgr10.num_blocks_held("a") == 0
