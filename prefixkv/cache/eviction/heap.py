"""The machinery shared by the ranked policies: a lazy-deletion heap of free blocks."""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from ..block import KVCacheBlock
from .base import EvictionPolicy


class HeapPolicy(EvictionPolicy):
    """Base for policies that rank free blocks by a key computed when the block becomes free:
    the victim is the free block with the smallest `(key, seq)`, where `seq` counts appends, so
    equal keys fall back to the LRU order (least recently freed first, tail of a request
    first). A binary heap with lazy deletion: O(log n) append and pop, O(1) remove; stale entries
    are dropped as they surface and the heap is rebuilt when they outnumber live ones.

    A subclass defines `key(block)` (the default, 0 for every block, is the LRU order) or
    overrides `append_n` to rank blocks freed together and push them with `_push`. It may read
    `hits[block_id]` - hits on the block's current identity, counted both while it is free
    (`remove`) and while it is held (`on_hit`) - and `_seq`, the append counter, and may extend
    `on_pop`, called when a block leaves the free set as a victim."""

    name = "heap"

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        n = len(blocks)
        self._blocks = blocks
        self._live = [0] * n  # block id -> seq of its live heap entry (when it was freed), 0 when not free
        self.hits = [0] * n
        self._heap: list[tuple[float, int, int]] = [(-1, i + 1, b.block_id) for i, b in enumerate(blocks)]
        self._seq = n
        for i, block in enumerate(blocks):
            self._live[block.block_id] = i + 1
        self._num_free = n

    def key(self, block: KVCacheBlock) -> float:
        """Rank of a block that becomes free now: smaller goes first."""
        return 0

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    def on_hit(self, block: KVCacheBlock) -> None:
        self.hits[block.block_id] += 1

    def on_pop(self, block: KVCacheBlock, freed_at: int) -> None:
        """`block` leaves the free set as a victim; it still carries its old identity, if any, and
        was freed at append count `freed_at`. Its hit count restarts with its next identity."""
        self.hits[block.block_id] = 0

    def popleft(self) -> KVCacheBlock:
        heap, live = self._heap, self._live
        while heap:
            _, seq, bid = heapq.heappop(heap)
            if live[bid] == seq:
                live[bid] = 0
                self._num_free -= 1
                block = self._blocks[bid]
                self.on_pop(block, seq)
                return block
        raise ValueError("no free block to pop")

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self._push(block, self.key(block))

    def append(self, block: KVCacheBlock) -> None:
        self._push(block, self.key(block))

    def remove(self, block: KVCacheBlock) -> None:
        bid = block.block_id
        if not self._live[bid]:
            raise ValueError(f"block {bid} is not in the free queue")
        self._live[bid] = 0
        self._num_free -= 1
        self.hits[bid] += 1

    def push_front(self, block: KVCacheBlock) -> None:
        # a new live entry ranked below every key; the old one turns stale (lazy deletion)
        bid = block.block_id
        if not self._live[bid]:
            raise ValueError(f"block {bid} is not in the free queue")
        self._seq += 1
        self._live[bid] = self._seq
        heapq.heappush(self._heap, (float("-inf"), self._seq, bid))
        if len(self._heap) > 2 * len(self._blocks) + 64:
            self._compact()

    def freed_at(self, block: KVCacheBlock) -> int:
        """The append count at which a free block was freed; 0 when it is not free."""
        return self._live[block.block_id]

    def _push(self, block: KVCacheBlock, key: float) -> None:
        bid = block.block_id
        if self._live[bid]:
            raise ValueError(f"block {bid} is already free")
        self._seq += 1
        self._live[bid] = self._seq
        self._num_free += 1
        heapq.heappush(self._heap, (key, self._seq, bid))
        if len(self._heap) > 2 * len(self._blocks) + 64:
            self._compact()

    def _compact(self) -> None:
        live = self._live
        self._heap = [e for e in self._heap if live[e[2]] == e[1]]
        heapq.heapify(self._heap)

    def block_ids(self) -> list[int]:
        live = self._live
        return [bid for _, _, bid in sorted(e for e in self._heap if live[e[2]] == e[1])]
