"""The block pool: every KVCacheBlock, the free set (owned by an eviction policy) and the table
from exact identity to cached block(s)."""
from __future__ import annotations

from typing import Iterable

from .block import KVCacheBlock
from .events import AllBlocksCleared, BlockRemoved, KVCacheEvent
from .identity import BlockKey
from .policies import EvictionPolicy, LRUPolicy


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 policy: type[EvictionPolicy] = LRUPolicy, enable_events: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue: EvictionPolicy = policy(self.blocks)
        # A policy that wants hits on held blocks defines on_hit (hits on free blocks reach it
        # as remove); the default policy does not, and its touch() path stays as it was.
        if getattr(self.free_block_queue, "on_hit", None) is not None:
            self.touch = self._touch_notify  # type: ignore[method-assign]
        # Exact identity -> the block holding it, or {block_id: block} when several do: block
        # tables are append-only, so two requests that computed the same block both keep theirs.
        self.cached_blocks: dict[BlockKey, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        self._next_uid = 1  # 0 is identity.ROOT_UID
        self.events: list[KVCacheEvent] | None = [] if enable_events else None
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_blocks

    # vLLM's names, for code and tests written against its BlockPool
    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return self.usage

    @property
    def cached_block_hash_to_block(self) -> dict:
        return self.cached_blocks

    def get_cached_block(self, key: BlockKey) -> KVCacheBlock | None:
        entry = self.cached_blocks.get(key)
        if entry is None or type(entry) is KVCacheBlock:
            return entry
        return next(iter(entry.values()))

    def cache_block(self, block: KVCacheBlock, key: BlockKey) -> None:
        """Enter a full block under its exact identity; a duplicate shares the identity's uid."""
        entry = self.cached_blocks.get(key)
        if entry is None:
            self.cached_blocks[key] = block
            block.uid = self._next_uid
            self._next_uid += 1
        elif type(entry) is KVCacheBlock:
            self.cached_blocks[key] = {entry.block_id: entry, block.block_id: block}
            block.uid = entry.uid
        else:
            block.uid = next(iter(entry.values())).uid
            entry[block.block_id] = block
        block.block_hash = key

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take n blocks from the policy's victims; cached ones lose their identity on the way."""
        if n > self.free_block_queue.num_free_blocks:
            raise ValueError(f"cannot get {n} free blocks from the pool")
        blocks = self.free_block_queue.popleft_n(n)
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        key = block.block_hash
        entry = self.cached_blocks[key]
        if type(entry) is KVCacheBlock:
            del self.cached_blocks[key]
        else:
            del entry[block.block_id]
            if not entry:
                del self.cached_blocks[key]
        if self.events is not None and block.content_hash is not None:
            self.events.append(BlockRemoved([block.content_hash]))
        block.block_hash = None
        block.uid = 0
        block.content_hash = None
        self.num_evictions += 1

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Cache hits: one more holder each; a block nobody held leaves the free set."""
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def _touch_notify(self, blocks: Iterable[KVCacheBlock]) -> None:
        queue = self.free_block_queue
        on_hit = queue.on_hit  # type: ignore[attr-defined]
        for block in blocks:
            if block.ref_cnt == 0:
                queue.remove(block)
            else:
                on_hit(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """One holder fewer each; blocks nobody holds go to the free set in the given order
        (first = evicted first) and keep their identity until they are reused."""
        to_free = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                to_free.append(block)
        self.free_block_queue.append_n(to_free)

    def reset_prefix_cache(self) -> bool:
        """Forget every identity; refused (False) while any block is held."""
        if self.free_block_queue.num_free_blocks != self.num_blocks:
            return False
        self.cached_blocks.clear()
        for block in self.blocks:
            block.block_hash = None
            block.uid = 0
            block.content_hash = None
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        if not self.events:
            return []
        events, self.events = self.events, []
        return events
