"""Tiers below the KV pool, for the replay simulator: one engine's CPU tier (`prefixkv replay
--cpu-tier-blocks N`, CPUTier) and a tier all replicas share (`--replicas N --shared-tier-blocks M`,
SharedTier, the LRU both are built on).

What it models (the CPU tier of prefixkv/tiers/, keyed by the chained content hash):
  * a cached block that the pool evicts is copied to the tier (it enters as most recently used);
  * the tier holds `num_blocks` blocks, LRU: a full tier drops its least recently used block;
  * a request's lookup continues the chain where the pool's hits end: every following prompt block
    found in the tier is a tier hit (loaded back into the pool, so the request does not recompute
    it), up to the first block the tier does not hold; the engine's lookup rule still applies
    (whole blocks, at most input_length - 1 tokens);
  * a loaded block keeps its copy in the tier (touched), and re-enters the pool as that request's
    block, so its next eviction copies it back (a touch).
The pool's evictions reach the tier through the manager's own KV events (BlockRemoved with the
content hash), the way an offloading connector would learn them. Transfer time is not modelled:
the hold time of a request does not depend on its hits (simulator.TimeModel), so the tier changes
hit rates, not admission order.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Container, Iterable, Sequence
from typing import Any

from prefixkv.cache import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent


def fast_block_hash(obj: Any) -> bytes:
    """The chained content hash used in replays: Python's tuple hash, 64 bits. Blocks are already
    told apart exactly by the manager; this only names them for the tier, within one process, and
    costs a fraction of sha256 over CBOR on 512-token blocks."""
    return hash(obj).to_bytes(8, "big", signed=True)


class SharedTier:
    """A tier every replica reads and writes (a shared Redis), for `prefixkv replay --replicas N
    --shared-tier-blocks M`: LRU over content hashes. Every replica's pool evictions enter it;
    any replica's lookup may continue its chain there (a pool's own later blocks, kept while a
    parent was evicted, also continue it: the caller passes that replica's pool census)."""

    __slots__ = ("capacity", "_blocks", "num_inserted", "num_dropped", "num_hit_blocks")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a shared tier needs at least 1 block, got {num_blocks}")
        self.capacity = num_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self.num_inserted = 0
        self.num_dropped = 0
        self.num_hit_blocks = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def put(self, block_hash: bytes) -> tuple[bool, bytes | None]:
        """Store (or touch) a block; returns whether it is new here and the block the tier dropped
        to make room (None when none)."""
        blocks = self._blocks
        if block_hash in blocks:
            blocks.move_to_end(block_hash)
            return False, None
        blocks[block_hash] = None
        self.num_inserted += 1
        if len(blocks) > self.capacity:
            dropped, _ = blocks.popitem(last=False)
            self.num_dropped += 1
            return True, dropped
        return True, None

    def continue_chain(self, hashes: Sequence[bytes], start: int, stop: int, in_pool: Container[bytes]) -> int:
        """Blocks [start, stop) of a chain found here (touched) or in the replica's own pool,
        consecutively from `start`."""
        blocks = self._blocks
        n = start
        while n < stop:
            h = hashes[n]
            if h in blocks:
                blocks.move_to_end(h)
            elif h not in in_pool:
                break
            n += 1
        self.num_hit_blocks += n - start
        return n - start


class CPUTier(SharedTier):
    """One engine's CPU tier: a SharedTier fed by its own pool's KV events, which also keep the
    pool's census (a chain continued in the tier may run into a block the pool still caches, its
    parent evicted first)."""

    __slots__ = ("_in_pool",)

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a CPU tier needs at least 1 block, got {num_blocks}")
        super().__init__(num_blocks)
        self._in_pool: Counter[bytes] = Counter()

    def on_events(self, events: Iterable[KVCacheEvent]) -> None:
        """The pool's evictions enter the tier; stores and evictions keep the pool's census."""
        in_pool = self._in_pool
        for event in events:
            if isinstance(event, BlockStored):
                in_pool.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self.put(h)
                    left = in_pool[h] - 1
                    if left > 0:
                        in_pool[h] = left
                    else:
                        del in_pool[h]
            elif isinstance(event, AllBlocksCleared):
                in_pool.clear()  # a pool reset does not reach the tier (it is keyed by content)

    def continue_chain(
        self, hashes: Sequence[bytes], start: int, stop: int, in_pool: Container[bytes] | None = None
    ) -> int:
        """Blocks [start, stop) of a chain found in the tier (touched) - or still cached in the pool
        past a block the pool lost - consecutively from `start`."""
        return super().continue_chain(hashes, start, stop, self._in_pool if in_pool is None else in_pool)
