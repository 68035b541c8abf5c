"""The default policy's intrusive free queue."""

import pytest

from prefixkv.cache import KVCacheBlock, LRUPolicy, get_policy


def make(n):
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, LRUPolicy(blocks)


def test_starts_in_id_order_and_pops_from_head():
    blocks, q = make(4)
    assert q.block_ids() == [0, 1, 2, 3] and q.num_free_blocks == 4
    assert q.popleft() is blocks[0]
    assert [b.block_id for b in q.popleft_n(2)] == [1, 2]
    assert q.block_ids() == [3] and q.num_free_blocks == 1


def test_remove_from_middle_and_append_to_tail():
    blocks, q = make(5)
    q.remove(blocks[2])
    assert q.block_ids() == [0, 1, 3, 4]
    q.append(blocks[2])
    assert q.block_ids() == [0, 1, 3, 4, 2]
    q.remove(blocks[0])
    q.remove(blocks[2])
    q.append_n([blocks[2], blocks[0]])
    assert q.block_ids() == [1, 3, 4, 2, 0] and q.num_free_blocks == 5


def test_empty_queue_errors():
    blocks, q = make(1)
    q.popleft()
    with pytest.raises(ValueError):
        q.popleft()
    with pytest.raises(ValueError):
        q.popleft_n(1)
    with pytest.raises(ValueError):
        q.remove(blocks[0])
    q.append_n([])
    assert q.block_ids() == []


def test_unknown_policy_is_a_clear_error():
    assert get_policy("lru") is LRUPolicy
    with pytest.raises(ValueError, match="unknown eviction policy 'nope'"):
        get_policy("nope")


# -- the replay's alternative policies ---------------------------------------------------------
from prefixkv.cache import KVCacheManager  # noqa: E402
from prefixkv.cache.eviction import (  # noqa: E402
    POLICIES,
    AdaptiveCreditPolicy,
    GhostCreditPolicy,
    HeapPolicy,
    LFUPolicy,
    PredictedReusePolicy,
    ReuseCreditPolicy,
    UnhashedFirstPolicy,
    register_policy,
)
from prefixkv.request import Request  # noqa: E402


def cached(block, key=("k",)):
    block.block_key = key
    return block


@pytest.mark.parametrize("cls", [UnhashedFirstPolicy, LFUPolicy, ReuseCreditPolicy, GhostCreditPolicy])
def test_heap_policies_share_the_queue_contract(cls):
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = cls(blocks)
    assert q.block_ids() == [0, 1, 2, 3, 4] and q.num_free_blocks == 5
    assert [b.block_id for b in q.popleft_n(2)] == [0, 1]
    q.remove(blocks[3])
    assert q.block_ids() == [2, 4] and q.num_free_blocks == 2
    q.append_n([blocks[1], blocks[0]])  # uncached, freed together: in the given order
    q.append(blocks[3])
    assert q.block_ids() == [2, 4, 1, 0, 3]
    q.remove(blocks[3])
    with pytest.raises(ValueError):
        q.remove(blocks[3])
    q.append(blocks[3])
    with pytest.raises(ValueError):
        q.append(blocks[2])
    assert len(q.popleft_n(5)) == 5 and q.num_free_blocks == 0
    with pytest.raises(ValueError):
        q.popleft()
    with pytest.raises(ValueError):
        q.popleft_n(1)


def test_heap_policy_compacts_stale_entries():
    blocks = [KVCacheBlock(i) for i in range(3)]
    q = UnhashedFirstPolicy(blocks)
    for _ in range(100):
        q.remove(blocks[1])
        q.append(blocks[1])
    assert len(q._heap) <= 2 * 3 + 64 + 1 and q.block_ids() == [0, 2, 1]


def test_unhashed_first_takes_blocks_without_identity_first():
    blocks = [KVCacheBlock(i) for i in range(4)]
    q = UnhashedFirstPolicy(blocks)
    taken = q.popleft_n(4)
    q.append_n([cached(taken[0]), taken[1], cached(taken[2]), taken[3]])
    assert q.block_ids() == [1, 3, 0, 2]  # plain blocks, then cached ones in LRU order


def test_lfu_counts_hits_on_free_and_held_blocks():
    blocks = [KVCacheBlock(i) for i in range(3)]
    q = LFUPolicy(blocks)
    b0, b1, b2 = q.popleft_n(3)
    q.on_hit(b0)  # held hits arrive through on_hit
    q.on_hit(b0)
    q.append_n([cached(b0), cached(b1), b2])
    assert q.block_ids() == [2, 1, 0]
    q.remove(b1)  # a hit on a free block counts too
    q.append(b1)
    assert q.block_ids() == [2, 1, 0]  # b1 has 1 hit, b0 has 2
    assert q.popleft() is b2 and q.popleft() is b1
    assert q.hits[1] == 0  # counts restart with the next identity


def test_reuse_credit_lets_reused_blocks_outlive_newer_one_off_blocks():
    blocks = [KVCacheBlock(i) for i in range(4)]
    q = ReuseCreditPolicy(blocks)
    old, a, b, c = q.popleft_n(4)
    q.on_hit(old)
    q.append(cached(old))  # freed first, but reused once: a credit of num_blocks appends
    q.append_n([cached(a), cached(b)])
    q.append(c)  # no identity: always first
    assert q.block_ids() == [3, 1, 2, 0]


def test_ghost_credit_remembers_evicted_content_that_comes_back():
    blocks = [KVCacheBlock(i) for i in range(4)]
    q = GhostCreditPolicy(blocks)
    a, b, c, d = q.popleft_n(4)
    q.append_n([cached(a, (0, (1, 2), None)), cached(b, (0, (3, 4), None))])
    assert q.popleft() is a  # evicted with its identity: remembered as a ghost
    a.block_key = None
    q.append_n([cached(c, (0, (5, 6), None))])  # new content, freed later than b
    # the same content as the evicted `a`, re-cached under a new parent identity
    q.append(cached(a, (7, (1, 2), None)))
    q.append(d)  # no identity: always first
    assert q.block_ids() == [3, 1, 2, 0]  # a's missed reuse buys it a credit
    assert q.popleft() is d and q.popleft() is b
    assert q.popleft() is c and q.popleft() is a
    assert len(q.credits) == 3  # b, c and a (again, with its credit)


def test_ghost_table_is_bounded():
    blocks = [KVCacheBlock(i) for i in range(2)]
    q = GhostCreditPolicy(blocks)
    for i in range(200):
        b = q.popleft()
        b.block_key = None
        q.append(cached(b, (0, (i,), None)))
    assert len(q.credits) <= q.credits.capacity == 32


def test_policies_are_registered_and_only_reuse_aware_ones_hook_the_pool():
    assert set(POLICIES) >= {"lru", "unhashed-first", "lfu", "reuse-credit", "ghost-credit"}
    mgr = KVCacheManager(8, 2, eviction_policy="lru")
    assert not mgr.block_pool.notifies_hits and mgr._on_request_free is None  # the default path calls no hook
    mgr = KVCacheManager(8, 2, eviction_policy="lfu")
    a, b = Request("a", [1, 2, 3, 4, 5]), Request("b", [1, 2, 3, 4, 6])
    for req in (a, b):  # b hits a's two blocks while a still holds them
        hits, n = mgr.get_computed_blocks(req)
        assert mgr.allocate_slots(req, req.num_tokens - n, hits) is not None
        req.num_computed_tokens = req.num_tokens
    held = mgr.get_blocks("b")[:2]
    assert [mgr.block_pool.eviction_policy.hits[blk.block_id] for blk in held] == [1, 1]
    mgr.free(a)
    mgr.free(b)
    assert mgr.num_free_blocks == 8


def test_a_new_policy_is_one_small_class():
    @register_policy
    class MRU(HeapPolicy):
        name = "test-mru"

        def key(self, block):
            return -self._seq

    try:
        mgr = KVCacheManager(4, 2, eviction_policy="test-mru")
        assert isinstance(mgr.block_pool.eviction_policy, MRU)
    finally:
        del POLICIES["test-mru"]


def test_adaptive_credit_switches_unproven_chains_to_newest_first_when_reuses_are_far():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = AdaptiveCreditPolicy(blocks)
    a, b, c, d, e = q.popleft_n(5)
    assert not q.mru  # no reuse seen yet: ghost-credit's order (oldest first)
    q.append_n([cached(a, (0, (1,), None))])
    q.append_n([cached(b, (0, (2,), None))])
    assert q.block_ids() == [0, 1]
    q.remove(a)  # reused 2 frees after it was freed: near (<= num_blocks)
    q.remove(b)
    assert not q.mru
    for _ in range(3):  # three far reuses outweigh the two near ones
        q.distances.observe(10 * len(blocks))
    assert q.mru
    q.append_n([c])  # no identity: always first
    q.append_n([a, b])  # credited by their hits: after every unproven block, oldest first
    q.append_n([cached(e, (0, (3,), None))])  # unproven
    q.append_n([cached(d, (0, (4,), None))])  # unproven, freed last: first of them under MRU
    assert q.block_ids() == [2, 3, 4, 0, 1]
    # a ghost return far away counts as a far reuse
    assert q.popleft() is c and q.popleft() is d
    far = q.distances.far
    d.block_key = None
    q._seq += 10 * len(blocks)
    q.append(cached(d, (5, (4,), None)))  # d's evicted content comes back
    assert q.distances.far > far and q.block_ids()[-1] == 3  # with its ghost credit, freed last


def test_adaptive_credit_replays_like_the_others():
    mgr = KVCacheManager(8, 2, eviction_policy="adaptive-credit")
    for i in range(6):
        req = Request(str(i), [1, 2, 3, 4, 10 + i])
        hits, n = mgr.get_computed_blocks(req)
        assert mgr.allocate_slots(req, req.num_tokens - n, hits) is not None
        req.num_computed_tokens = req.num_tokens
        mgr.free(req)
    assert mgr.num_free_blocks == 8


def test_predicted_reuse_learns_which_finished_requests_come_back():
    blocks = [KVCacheBlock(i) for i in range(4)]
    q = PredictedReusePolicy(blocks)
    for i in range(30):  # short answers come back, long ones never do
        a, b = q.popleft_n(2)
        q.on_request_free(100, 10)
        q.append_n([cached(a, (0, (i, 1), None))])
        q.on_request_free(100, 2000)
        q.append_n([cached(b, (0, (i, 2), None))])
        short_cls, long_cls = q._cls[a.block_id], q._cls[b.block_id]
        q.remove(a)
        a.block_key = None
        q.append(a)
    assert q.rates.rate(short_cls) > 0.8 > 0.2 > q.rates.rate(long_cls)
    c, d = q.popleft_n(2)
    q.on_request_free(100, 10)
    q.append_n([cached(c, (0, (99, 1), None))])
    q.on_request_free(100, 2000)  # freed later, but from the class that never returns
    q.append_n([cached(d, (0, (99, 2), None))])
    assert q.popleft() is not None  # whatever is left of the loop (no identity) goes first
    rest = [bid for bid in q.block_ids()]
    assert rest.index(d.block_id) < rest.index(c.block_id)


def test_predicted_reuse_never_ranks_a_block_above_its_parent():
    blocks = [KVCacheBlock(i) for i in range(3)]
    q = PredictedReusePolicy(blocks)
    root, mid, leaf = q.popleft_n(3)
    q.rates.reused[:] = [float(i % 7) for i in range(len(q.rates.reused))]  # rates rising with tail distance
    q.rates.freed[:] = [7.0] * len(q.rates.freed)
    q.on_request_free(30, 1)
    q.append_n([cached(leaf, (2, (3,), None)), cached(mid, (1, (2,), None)), cached(root, (0, (1,), None))])
    assert q.block_ids() == [leaf.block_id, mid.block_id, root.block_id]


def test_the_manager_tells_learning_policies_what_a_finished_request_produced():
    seen = []

    @register_policy
    class Recorder(HeapPolicy):
        name = "test-recorder"

        def on_request_free(self, num_prompt_tokens, num_output_tokens):
            seen.append((num_prompt_tokens, num_output_tokens))

    try:
        mgr = KVCacheManager(8, 2, eviction_policy="test-recorder")
        req = Request("a", [1, 2, 3, 4, 5])
        hits, n = mgr.get_computed_blocks(req)
        mgr.allocate_slots(req, req.num_tokens - n, hits)
        req.num_computed_tokens = req.num_tokens
        req.append_output_token_ids([7, 8])
        mgr.allocate_slots(req, 2)
        mgr.free(req)
        assert seen == [(5, 2)] and mgr.num_free_blocks == 8
    finally:
        del POLICIES["test-recorder"]


def test_priority_policy_evicts_the_least_important_requests_blocks_first():
    from prefixkv.cache import KVCacheManager

    mgr = KVCacheManager(num_blocks=8, block_size=4, eviction_policy="priority")
    important = Request("vip", list(range(1, 10)), priority=-5)  # lower value: more important (vLLM)
    flood = [Request(f"low{i}", list(range(100 * i + 100, 100 * i + 109)), priority=10) for i in range(2)]
    for req in [important, *flood]:
        hits, n = mgr.get_computed_blocks(req)
        assert mgr.allocate_slots(req, req.num_tokens - n, hits) is not None
        req.num_computed_tokens = req.num_tokens
        mgr.free(req)
    newcomer = Request("new", list(range(1000, 1021)))  # six blocks: only two of the nine cached survive
    assert mgr.allocate_slots(newcomer, newcomer.num_tokens) is not None
    assert mgr.get_computed_blocks(Request("vip-again", list(range(1, 10))))[1] == 8
