"""The default policy: vLLM's LRU free queue, an intrusive doubly linked list (the hot path)."""

from __future__ import annotations

from collections.abc import Iterable

from ..block import KVCacheBlock
from .base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """vLLM's order: least recently freed first; among blocks freed together, the one with
    the longest prefix first (the pool frees a request's table tail-first). An intrusive doubly
    linked list over the blocks themselves (`prev_free_block` / `next_free_block`), with
    sentinels: every operation is O(1) and none allocates. It defines no hook, so the pool and
    manager call none on this path."""

    name = "lru"

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels: no branches for empty or end cases
        self._tail = KVCacheBlock(-1)
        self._num_free = len(blocks)
        prev = self._head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self._tail
        self._tail.prev_free_block = prev

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    def popleft(self) -> KVCacheBlock:
        block: KVCacheBlock = self._head.next_free_block
        if block is self._tail:
            raise ValueError("no free block to pop")
        nxt = block.next_free_block
        self._head.next_free_block = nxt
        nxt.prev_free_block = self._head
        block.prev_free_block = block.next_free_block = None
        self._num_free -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self._num_free:
            raise ValueError(f"asked for {n} free blocks, {self._num_free} free")
        out = []
        block = self._head
        for _ in range(n):
            block = block.next_free_block
            out.append(block)
        nxt = block.next_free_block
        self._head.next_free_block = nxt
        nxt.prev_free_block = self._head
        for block in out:
            block.prev_free_block = block.next_free_block = None
        self._num_free -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self._num_free -= 1

    def push_front(self, block: KVCacheBlock) -> None:
        self.remove(block)
        first = self._head.next_free_block
        self._head.next_free_block = block
        block.prev_free_block = self._head
        block.next_free_block = first
        first.prev_free_block = block
        self._num_free += 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self._num_free += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        last = self._tail.prev_free_block
        n = 0
        for block in blocks:
            last.next_free_block = block
            block.prev_free_block = last
            last = block
            n += 1
        last.next_free_block = self._tail
        self._tail.prev_free_block = last
        self._num_free += n

    def block_ids(self) -> list[int]:
        ids = []
        block = self._head.next_free_block
        while block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free_block
        return ids


# vLLM's name for the default policy's structure.
FreeKVCacheBlockQueue = LRUPolicy
