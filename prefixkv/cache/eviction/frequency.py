"""Ranked policies that need no memory beyond the current identity: unhashed-first and LFU."""

from __future__ import annotations

from ..block import KVCacheBlock
from .heap import HeapPolicy


class UnhashedFirstPolicy(HeapPolicy):
    """Free blocks without a cached identity (partial blocks, reserved decode room, evicted
    leftovers) are reused before any cached block; among each group, the LRU order."""

    name = "unhashed-first"

    def key(self, block: KVCacheBlock) -> float:
        return 0 if block.block_key is None else 1


class LFUPolicy(HeapPolicy):
    """Least frequently used: the free block whose identity was hit the fewest times goes first
    (blocks without identity before all), LRU among equals. Counts restart when a block is
    reused for a new identity."""

    name = "lfu"

    def key(self, block: KVCacheBlock) -> float:
        return -1 if block.block_key is None else self.hits[block.block_id]
