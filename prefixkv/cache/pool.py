"""The block pool: every KVCacheBlock, the free set (owned by an eviction policy), the table from
exact identity to cached block(s), and the pending KV events."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .block import KVCacheBlock
from .events import AllBlocksCleared, BlockRemoved, KVCacheEvent, KVEventBuffer
from .eviction import EvictionPolicy, LRUPolicy, overrides
from .identity import BlockKey, ExtraKeys
from .residency import ResidencyMetrics
from .table import CachedBlockTable


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        policy: type[EvictionPolicy] = LRUPolicy,
        enable_events: bool = False,
        max_pending_events: int = 10_000,
        residency: ResidencyMetrics | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.eviction_policy: EvictionPolicy = policy(self.blocks)
        # Hits on held blocks reach a policy that overrides on_hit (hits on free blocks reach
        # every policy as remove); the default one does not, and its touch path stays plain.
        self.notifies_hits = overrides(self.eviction_policy, "on_hit")
        self.touch: Callable[[Iterable[KVCacheBlock]], None] = self._touch_notify if self.notifies_hits else self._touch
        # sampled residency metrics (residency.py): called once per pool call, and only when on
        self.residency = residency
        if residency is not None:
            self.touch = self._touch_followed
        self.cached_blocks = CachedBlockTable()
        self.events: KVEventBuffer | None = KVEventBuffer(max_pending_events) if enable_events else None
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return self.eviction_policy.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.eviction_policy.num_free_blocks / self.num_blocks

    # vLLM's names, for code and tests written against its BlockPool
    def get_num_free_blocks(self) -> int:
        return self.eviction_policy.num_free_blocks

    def get_usage(self) -> float:
        return self.usage

    @property
    def free_block_queue(self) -> EvictionPolicy:
        return self.eviction_policy

    @property
    def cached_block_hash_to_block(self) -> CachedBlockTable:
        return self.cached_blocks

    def get_cached_block(self, key: BlockKey) -> KVCacheBlock | None:
        return self.cached_blocks.get_one_block(key)

    def cache_block(self, block: KVCacheBlock, key: BlockKey) -> None:
        """Enter a full block under its exact identity; a duplicate shares the identity's uid."""
        self.cached_blocks.insert(key, block)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take n blocks from the policy's victims; cached ones lose their identity on the way."""
        if n > self.eviction_policy.num_free_blocks:
            raise ValueError(f"cannot get {n} free blocks from the pool")
        blocks = self.eviction_policy.popleft_n(n)
        if self.residency is not None:
            self.residency.on_allocate(blocks)
        evict = self.cached_blocks.remove
        num_evicted = 0
        for block in blocks:
            if block.block_key is not None:  # evicted: it leaves the table, losing its identity
                evict(block)
                num_evicted += 1
                if block.content_hash is not None:
                    self._removed(block)
            block.ref_cnt = 1
        self.num_evictions += num_evicted
        return blocks

    def _removed(self, block: KVCacheBlock) -> None:
        """An evicted block's content hash leaves with it (a BlockRemoved event when events are on)."""
        if self.events is not None and block.content_hash is not None:
            self.events.append(BlockRemoved([block.content_hash], group_idx=block.group_idx))
        block.content_hash = None

    def _touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Cache hits: one more holder each; a block nobody held leaves the free set."""
        policy = self.eviction_policy
        for block in blocks:
            if block.ref_cnt == 0:
                policy.remove(block)
            block.ref_cnt += 1

    def _touch_notify(self, blocks: Iterable[KVCacheBlock]) -> None:
        """`_touch`, telling the policy of hits on blocks someone already holds."""
        policy = self.eviction_policy
        on_hit = policy.on_hit
        for block in blocks:
            if block.ref_cnt == 0:
                policy.remove(block)
            else:
                on_hit(block)
            block.ref_cnt += 1

    def _touch_followed(self, blocks: Iterable[KVCacheBlock]) -> None:
        """`_touch` or `_touch_notify`, telling the residency metrics of the reuses."""
        blocks = list(blocks)
        (self._touch_notify if self.notifies_hits else self._touch)(blocks)
        assert self.residency is not None
        self.residency.on_access(blocks)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """One holder fewer each; blocks nobody holds go to the free set in the given order
        (first = evicted first) and keep their identity until they are reused."""
        to_free = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                to_free.append(block)
        self.eviction_policy.append_n(to_free)
        if self.residency is not None:
            self.residency.on_release(to_free)

    def evict_where(self, match: Callable[[ExtraKeys], bool]) -> tuple[int, int]:
        """Drop the identity of every free cached block whose extra keys satisfy `match` and make
        it a next victim: for content that can never be hit again (an unloaded LoRA adapter's
        blocks). Blocks held by running requests keep theirs - their successors' keys name them -
        and are only counted. Returns (blocks evicted, matching blocks still held)."""
        evicted, held = [], 0
        for key, blocks in self.cached_blocks.items():
            if key[2] is not None and match(key[2]):
                for block in blocks:
                    if block.ref_cnt == 0:
                        evicted.append(block)
                    else:
                        held += 1
        if self.residency is not None:
            self.residency.on_evict(evicted, "unreachable")
        for block in evicted:
            self.cached_blocks.remove(block)
            if block.content_hash is not None:
                self._removed(block)
            self.eviction_policy.push_front(block)
        self.num_evictions += len(evicted)
        return len(evicted), held

    def reset_prefix_cache(self, pinned: Callable[[int], int] | None = None) -> bool:
        """Forget every identity; refused (False) while any block is held. With `pinned` (block
        id -> how many pins hold it) the pinned blocks keep theirs, and blocks held by pins only do
        not refuse the reset."""
        if pinned is None:
            if self.eviction_policy.num_free_blocks != self.num_blocks:
                return False
            if self.residency is not None:
                self.residency.on_evict([b for b in self.blocks if b.block_key is not None], "reset")
            self.cached_blocks.clear()
            for block in self.blocks:
                block.block_key = None
                block.uid = 0
                block.content_hash = None
            if self.events is not None:
                self.events.append(AllBlocksCleared())
            return True
        if not self.held_only_by(pinned):
            return False
        dropped = [b for b in self.blocks if b.block_key is not None and not pinned(b.block_id)]
        if self.residency is not None:
            self.residency.on_evict(dropped, "reset")
        for block in dropped:
            self.cached_blocks.remove(block)
            self._removed(block)  # a BlockRemoved each: the pinned blocks stay stored
        return True

    def held_only_by(self, pinned: Callable[[int], int]) -> bool:
        """Whether every held block is held by pins alone (`pinned`: block id -> pins holding it)."""
        return all(b.ref_cnt == pinned(b.block_id) for b in self.blocks if b.ref_cnt)

    @property
    def num_dropped_events(self) -> int:
        return self.events.num_dropped if self.events is not None else 0

    def take_events(self) -> list[KVCacheEvent]:
        """Pending events, oldest first (drained); [] when events are off."""
        return self.events.drain() if self.events is not None else []
