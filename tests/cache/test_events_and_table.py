"""The bounded KV-event buffer, the cached-block table, the pool's vLLM names and the package's
import boundary."""

import subprocess
import sys
from pathlib import Path

import pytest

from prefixkv.cache import (
    POLICIES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CachedBlockTable,
    EvictionPolicy,
    KVCacheBlock,
    KVCacheManager,
    KVEventBuffer,
    LRUPolicy,
    get_policy,
)
from prefixkv.request import Request

from .conftest import prefill


# -- events --------------------------------------------------------------------------------------
def test_event_buffer_keeps_the_newest_and_counts_drops():
    buf = KVEventBuffer(3)
    events = [BlockRemoved([bytes([i])]) for i in range(5)]
    for e in events:
        buf.append(e)
    assert len(buf) == 3 and buf.num_dropped == 2
    assert buf.drain() == events[2:]  # oldest first
    assert buf.drain() == [] and len(buf) == 0 and buf.num_dropped == 2
    with pytest.raises(ValueError, match="max_pending_kv_events"):
        KVEventBuffer(0)


def test_manager_events_are_bounded_and_drained_in_order():
    mgr = KVCacheManager(num_blocks=4, block_size=2, enable_kv_cache_events=True, max_pending_kv_events=4)
    for i in range(10):  # each request stores one block (and holds a partial one)
        req = Request(str(i), [10 * i, 10 * i + 1, 10 * i + 2])
        prefill(mgr, req)
        mgr.free(req)
    evictions = mgr.block_pool.num_evictions
    assert evictions == 8  # every request from the third on evicts one cached block
    # 10 stored + 8 removed events; only the newest 4 wait, the 14 older ones were dropped
    assert mgr.num_dropped_kv_events == 10 + evictions - 4
    events = mgr.take_events()
    assert [type(e) for e in events] == [BlockRemoved, BlockStored, BlockRemoved, BlockStored]
    assert [e.token_ids for e in events if isinstance(e, BlockStored)] == [[80, 81], [90, 91]]
    assert mgr.take_events() == [] and mgr.num_dropped_kv_events == 14
    assert mgr.reset_prefix_cache() and mgr.take_events() == [AllBlocksCleared()]


def test_events_off_means_nothing_pending():
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    prefill(mgr, Request("a", [1, 2, 3]))
    assert mgr.block_pool.events is None and mgr.take_events() == [] and mgr.num_dropped_kv_events == 0


# -- the cached-block table ------------------------------------------------------------------------
def test_table_holds_duplicates_and_promotes_the_oldest():
    table = CachedBlockTable()
    a, b, c, d = (KVCacheBlock(i) for i in range(4))
    key, other = (0, (1, 2), None), (0, (3, 4), None)
    table.insert(key, a)
    table.insert(other, d)
    table.insert(key, b)
    table.insert(key, c)
    assert a.uid == b.uid == c.uid != d.uid and b.block_key == key
    assert table.get_one_block(key) is a and table.get_blocks(key) == [a, b, c]
    assert len(table) == 2 and key in table and dict(table.items()) == {key: [a, b, c], other: [d]}
    table.remove(b)  # a duplicate leaves
    assert table.get_blocks(key) == [a, c] and b.block_key is None and b.uid == 0
    table.remove(a)  # the first leaves: the oldest remaining takes its place
    assert table.get_one_block(key) is c and table.get_blocks(key) == [c]
    uid = c.uid
    table.remove(c)
    assert key not in table and table.get_blocks(key) == [] and table.get_one_block(key) is None
    table.insert(key, a)  # the same identity again: a new number, never a reused one
    assert a.uid > uid
    table.clear()
    assert len(table) == 0 and table.get_one_block(key) is None and table.get_one_block(other) is None


# -- the pool's names --------------------------------------------------------------------------------
def test_pool_keeps_vllms_accessor_names():
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    prefill(mgr, Request("a", [1, 2, 3]))
    pool = mgr.block_pool
    assert pool.free_block_queue is pool.eviction_policy and isinstance(pool.eviction_policy, LRUPolicy)
    assert pool.get_num_free_blocks() == pool.num_free_blocks == 2 and pool.get_usage() == 0.5
    assert pool.cached_block_hash_to_block is pool.cached_blocks
    assert pool.get_cached_block(pool.blocks[0].block_key) is pool.blocks[0]


def test_policies_are_exported_by_name():
    assert all(issubclass(cls, EvictionPolicy) and cls.name == name for name, cls in POLICIES.items())
    assert get_policy(LRUPolicy) is LRUPolicy


def test_cache_package_imports_nothing_else_of_prefixkv():
    code = (
        "import sys, prefixkv.cache, prefixkv.cache.eviction; "
        "print(sorted(m for m in sys.modules if m.startswith('prefixkv')))"
    )
    root = Path(__file__).resolve().parents[2]
    # import the package without prefixkv/__init__ (which loads the engine): a stub parent
    stub = (
        "import sys, types; m = types.ModuleType('prefixkv'); "
        f"m.__path__ = [{str(root / 'prefixkv')!r}]; sys.modules['prefixkv'] = m; "
    )
    out = subprocess.run([sys.executable, "-c", stub + code], capture_output=True, text=True, check=True).stdout
    loaded = eval(out)
    assert loaded and all(m == "prefixkv" or m.startswith("prefixkv.cache") for m in loaded), loaded
