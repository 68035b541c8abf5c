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
