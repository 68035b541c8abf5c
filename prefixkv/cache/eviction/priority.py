"""Priority-aware retention: blocks of less important requests go first."""

from __future__ import annotations

from ..block import KVCacheBlock
from .heap import HeapPolicy


class PriorityPolicy(HeapPolicy):
    """The free block released by the least important request goes first - vLLM's request
    `priority`, where a larger value is less important - and among equals the seed's LRU order;
    blocks without a cached identity before all. A block shared by several requests is ranked by
    the request that released it last. Pins (pins.py) keep blocks out of every policy's reach;
    this orders the rest, so a flood of low-priority traffic evicts its own blocks before a
    high-priority request's prefix."""

    name = "priority"

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        super().__init__(blocks)
        self._priority = 0

    def on_request_priority(self, priority: int) -> None:
        self._priority = priority

    def key(self, block: KVCacheBlock) -> float:
        # content-less blocks before every priority, yet after push_front's -inf (dead content)
        return -1e308 if block.block_key is None else -float(self._priority)
