"""The interface every eviction policy implements, and the hooks the pool and manager call."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import ClassVar

from ..block import KVCacheBlock


class EvictionPolicy(ABC):
    """Owns the set of free blocks (ref count 0) and decides which one is reused next.

    The pool tells it when a block becomes free (`append`; `append_n` for blocks freed together,
    given in the order they should go: the tail of a request first) and when a free block is
    taken back by a cache hit (`remove`), and asks it for victims (`popleft`, `popleft_n`). A
    victim may still carry a cached identity (`block.block_key`): the pool evicts it after the
    policy gives it up. The pool's callers never see the policy, so policies can be swapped and
    compared.

    Three optional hooks have no-op defaults. The pool and the manager call a hook only when the
    policy's class overrides it (see `overrides`), so the default LRU path pays nothing for them.
    """

    name: ClassVar[str] = "abstract"

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
        """A free block was hit: it leaves the free set. Raises ValueError if it is not free."""

    @abstractmethod
    def append(self, block: KVCacheBlock) -> None:
        """A block's ref count dropped to 0."""

    @abstractmethod
    def block_ids(self) -> list[int]:
        """Free block ids in victim order (next victim first). For tests and inspection."""

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """The next n victims. Raises ValueError (taking none) when fewer are free."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, {self.num_free_blocks} free")
        return [self.popleft() for _ in range(n)]

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Blocks freed together, in the order they should be evicted (first = first)."""
        for block in blocks:
            self.append(block)

    def push_front(self, block: KVCacheBlock) -> None:
        """A free block whose identity was dropped (its content can never be hit again): make it
        the next victim, ahead of blocks that may still be hit. The default leaves it where it
        is; the built-in policies override it. Raises ValueError if it is not free."""

    # -- hooks: called only when overridden --------------------------------------------------
    def on_hit(self, block: KVCacheBlock) -> None:
        """A cache hit on a block that someone holds (hits on free blocks arrive as `remove`)."""

    def on_request_free(self, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """A request finished or was preempted; its blocks are appended right after this call."""

    def on_request_priority(self, priority: int) -> None:
        """The priority (vLLM's: lower is more important) of the request whose blocks are
        appended right after this call."""


def overrides(policy: EvictionPolicy, hook: str) -> bool:
    """Whether `policy`'s class overrides the hook `hook` of EvictionPolicy (checked once, when the
    pool or manager is built, so that hooks nobody implements cost nothing per block)."""
    return getattr(type(policy), hook) is not getattr(EvictionPolicy, hook)
