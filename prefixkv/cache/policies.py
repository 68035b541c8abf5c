"""Eviction policies: which free block (ref count 0) is reused next.

A policy owns the set of free blocks. The pool tells it when a block becomes free (`append`,
`append_n` for blocks freed together, given in the order they should go: the tail of a request
first) and when a free block is taken back by a cache hit (`remove`), and asks it for victims
(`popleft`). The pool's callers never see the policy, so policies can be swapped and compared.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterable

from .block import KVCacheBlock


class EvictionPolicy(ABC):
    name = "abstract"

    @abstractmethod
    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        """Start with every block free, lowest id first in victim order."""

    @property
    @abstractmethod
    def num_free_blocks(self) -> int: ...

    @abstractmethod
    def popleft(self) -> KVCacheBlock:
        """Remove and return the next victim. Raises ValueError when none is free."""

    @abstractmethod
    def remove(self, block: KVCacheBlock) -> None:
        """A free block was hit: it leaves the free set."""

    @abstractmethod
    def append(self, block: KVCacheBlock) -> None:
        """A block's ref count dropped to 0."""

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        return [self.popleft() for _ in range(n)]

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    @abstractmethod
    def block_ids(self) -> list[int]:
        """Free block ids in victim order (next victim first). For tests and inspection."""


class LRUPolicy(EvictionPolicy):
    """The seed's policy: least recently freed first; among blocks freed together, the one with
    the longest prefix first (the pool frees a request's table tail-first). An intrusive doubly
    linked list over the blocks themselves, with sentinels: every operation is O(1) and none
    allocates."""

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
        block = self._head.next_free_block
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


# The seed's name for the default policy's structure.
FreeKVCacheBlockQueue = LRUPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy}


def get_policy(name: str | type[EvictionPolicy]) -> type[EvictionPolicy]:
    if isinstance(name, type) and issubclass(name, EvictionPolicy):
        return name
    try:
        return POLICIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(POLICIES)}") from None
