"""The two worked examples of vLLM's "Automatic Prefix Caching" design document, reproduced exactly."""

from prefixkv.cache import KVCacheManager
from prefixkv.request import Request

from .conftest import cached_ids, decode, prefill

A, B, C, D, E, F, G, H, I = range(1, 10)


def test_duplicated_blocks():
    mgr = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    # Request 1: prompt ABCDEF; the model answers G, H, I.
    r1 = Request("r1", [A, B, C, D, E, F])
    prefill(mgr, r1)
    r1.append_output_token_ids([G])  # time 0: ABCDEFG
    assert mgr.get_block_ids("r1") == [0, 1] and cached_ids(mgr) == {0}
    decode(mgr, r1, H)  # computes G; time 1: ABCDEFGH, EFGH is full
    decode(mgr, r1, I)  # computes H
    assert cached_ids(mgr) == {0, 1}
    decode(mgr, r1, 99)  # computes I: needs block 2
    assert mgr.get_block_ids("r1") == [0, 1, 2] and cached_ids(mgr) == {0, 1}
    mgr.free(r1)

    # Request 2: the same prompt, same greedy answer.
    r2 = Request("r2", [A, B, C, D, E, F])
    hits, n = mgr.get_computed_blocks(r2)
    assert [b.block_id for b in hits] == [0] and n == 4  # EF.. is not full: no hit
    mgr.allocate_slots(r2, 2, hits)
    r2.num_computed_tokens = 6
    r2.append_output_token_ids([G])
    assert mgr.get_block_ids("r2") == [0, 3]  # time 0
    assert cached_ids(mgr) == {0, 1}
    decode(mgr, r2, H)
    decode(mgr, r2, I)  # computes H: EFGH full again, in block 3
    assert mgr.get_block_ids("r2") == [0, 3]  # append-only: 3 is not swapped for 1
    assert cached_ids(mgr) == {0, 1, 3}  # time 1: both copies of EFGH cached
    assert mgr.block_pool.blocks[1].block_key == mgr.block_pool.blocks[3].block_key
    mgr.free(r2)
    assert mgr.num_free_blocks == 10


def test_ten_block_walkthrough(mgr10):
    mgr = mgr10
    p0 = list(range(100, 114))  # 14 tokens
    r0 = Request("r0", p0)
    assert prefill(mgr, r0) == [0, 1, 2, 3]
    assert cached_ids(mgr) == {0, 1, 2}  # the fourth block holds 2 tokens
    r0.append_output_token_ids([200])
    decode(mgr, r0, 201)
    assert decode(mgr, r0, 202) == []  # computes token 16: block 3 is full and cached
    assert cached_ids(mgr) == {0, 1, 2, 3}
    assert decode(mgr, r0, 203) == [4]

    r1 = Request("r1", p0[:11] + [300, 301, 302])  # first 11 tokens equal request 0's
    hits, n = mgr.get_computed_blocks(r1)
    assert [b.block_id for b in hits] == [0, 1] and n == 8  # block 2 matches only 3 of 4
    assert [b.block_id for b in mgr.allocate_slots(r1, 14 - n, hits)] == [5, 6]
    r1.num_computed_tokens = 14

    mgr.free(r0)
    assert mgr.block_pool.eviction_policy.block_ids() == [7, 8, 9, 4, 3, 2]
    mgr.free(r1)
    assert mgr.block_pool.eviction_policy.block_ids() == [7, 8, 9, 4, 3, 2, 6, 5, 1, 0]

    # Request 2: 33 tokens, the first 12 equal request 0's (its block 3 holds generated tokens).
    r2 = Request("r2", p0[:12] + list(range(400, 421)))
    hits, n = mgr.get_computed_blocks(r2)
    assert [b.block_id for b in hits] == [0, 1, 2] and n == 12
    assert mgr.block_pool.eviction_policy.block_ids() == [7, 8, 9, 4, 3, 2, 6, 5, 1, 0]  # lookup changed nothing
    block3_key = mgr.block_pool.blocks[3].block_key
    assert block3_key is not None
    new = mgr.allocate_slots(r2, 33 - n, hits)
    assert [b.block_id for b in new] == [7, 8, 9, 4, 3, 6]
    assert mgr.get_block_ids("r2") == [0, 1, 2, 7, 8, 9, 4, 3, 6]
    assert mgr.block_pool.eviction_policy.block_ids() == [5]
    assert block3_key not in mgr.block_pool.cached_blocks  # evicted on the way
    r2.num_computed_tokens = 33
    mgr.free(r2)
    assert mgr.num_free_blocks == 10 and mgr.usage == 0.0
