"""prefixkv's credit policies - LRU in which reuse buys time - and the pieces they share: ghost
credits (the memory of evicted identities) and near/far reuse-distance counts."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import NamedTuple

from ..block import KVCacheBlock
from .heap import HeapPolicy


class Ghost(NamedTuple):
    """What is remembered of an evicted identity."""

    score: int  # its credits when it was evicted
    freed_at: int  # the append count at its last free
    cls: int = -1  # predicted-reuse's class of that free (-1 for the other policies)


class GhostCredits:
    """Credits of each block's current identity: its hits (the policy's `hits` list, shared) plus
    the credits it inherited from a ghost. A bounded FIFO ghost table (`capacity` entries) keeps,
    for each evicted identity, its credits; when the same content is cached again, the block
    starts with those credits plus `ghost_credit` for the reuse the cache missed. Ghosts are keyed
    by the block's content (its token tuple and extra keys; the parent is left out because its
    identity number changes when it is re-cached), hashed: so a ghost can only mis-rank a block,
    never serve a hit. `on_return` is told of every ghost that comes back."""

    def __init__(
        self, hits: list[int], capacity: int, ghost_credit: int, on_return: Callable[[Ghost], None] | None = None
    ) -> None:
        self.hits = hits
        self.capacity = capacity
        self.ghost_credit = ghost_credit
        self._on_return = on_return
        self._ghosts: OrderedDict[int, Ghost] = OrderedDict()
        self._bonus: list[int | None] = [None] * len(hits)  # inherited by the current identity

    def __len__(self) -> int:
        return len(self._ghosts)

    @staticmethod
    def ghost_key(block: KVCacheBlock) -> int:
        key = block.block_key
        assert key is not None, "only a cached block has a ghost"
        return hash(key[1:])  # (tokens, extra keys) of an exact key

    def score(self, block: KVCacheBlock) -> int:
        """Credits of a cached block's identity; the first call per identity claims its ghost."""
        bid = block.block_id
        bonus = self._bonus[bid]
        if bonus is None:
            ghost = self._ghosts.pop(self.ghost_key(block), None)
            if ghost is None:
                bonus = 0
            else:
                if self._on_return is not None:
                    self._on_return(ghost)
                bonus = ghost.score + self.ghost_credit
            self._bonus[bid] = bonus
        return self.hits[bid] + bonus

    def evicted(self, block: KVCacheBlock, freed_at: int, cls: int = -1) -> None:
        """`block` is evicted (it still carries its identity, if any): remember its credits; the
        counts of its next identity start from nothing."""
        if block.block_key is not None:
            ghosts = self._ghosts
            ghosts[self.ghost_key(block)] = Ghost(self.score(block), freed_at, cls)
            if len(ghosts) > self.capacity:
                ghosts.popitem(last=False)
        self._bonus[block.block_id] = None
        self.hits[block.block_id] = 0


class ReuseDistances:
    """Reuse distances, in frees, as exponentially decayed counts (`decay` per reuse) of near and
    far reuses; a reuse is far when its distance exceeds `far_limit`."""

    __slots__ = ("far_limit", "far_frac", "decay", "far", "near")

    def __init__(self, far_limit: float, far_frac: float, decay: float) -> None:
        self.far_limit = far_limit
        self.far_frac = far_frac
        self.decay = decay
        self.far = self.near = 0.0

    def observe(self, distance: int) -> None:
        d = self.decay
        if distance > self.far_limit:
            self.far = self.far * d + 1.0
            self.near *= d
        else:
            self.near = self.near * d + 1.0
            self.far *= d

    @property
    def mostly_far(self) -> bool:
        """Whether far reuses are more than `far_frac` of all."""
        return self.far > self.far_frac * (self.far + self.near)


class ReuseCreditPolicy(HeapPolicy):
    """prefixkv's own: LRU in which reuse buys time. Blocks without identity go first; a cached
    block is ranked by when it was freed (the append counter) plus `credit * num_blocks` for each
    hit its identity has had (both while free and while held), at most `max_credits` of them.
    A block that proved reusable thus survives a flood of one-off blocks about `credit` cache
    turnovers longer per reuse, while stale popular blocks still age out (unlike LFU). Within a
    request, tail-first freeing keeps children ahead of parents, as in the LRU order."""

    name = "reuse-credit"
    credit = 1.0
    max_credits = 4

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        super().__init__(blocks)
        self._step = self.credit * len(blocks)

    def key(self, block: KVCacheBlock) -> float:
        if block.block_key is None:
            return -1
        return self._seq + self._step * min(self.hits[block.block_id], self.max_credits)


class GhostCreditPolicy(HeapPolicy):
    """prefixkv's own: `reuse-credit` that also remembers what it evicted (GhostCredits, with
    `ghost_factor * num_blocks` ghosts; 16 by default, since reuse distances in the Mooncake
    traces are many cache turnovers long). So a block that proved reusable once - even if the
    reuse came after it was evicted, the common case when reuse distances exceed the cache - is
    protected from the next flood of one-off blocks."""

    name = "ghost-credit"
    credit = 1.0
    max_credits = 4
    ghost_factor = 16.0
    ghost_credit = 1
    horizon = 0  # if > 0: appends of extra life per credit, instead of credit * num_blocks

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        super().__init__(blocks)
        n = len(blocks)
        self._step = self.horizon or self.credit * n
        self.credits = GhostCredits(self.hits, max(1, int(self.ghost_factor * n)), self.ghost_credit)

    def key(self, block: KVCacheBlock) -> float:
        if block.block_key is None:
            return -1
        return self._seq + self._step * min(self.credits.score(block), self.max_credits)

    def on_pop(self, block: KVCacheBlock, freed_at: int) -> None:
        self.credits.evicted(block, freed_at)


class AdaptiveCreditPolicy(HeapPolicy):
    """prefixkv's own: `ghost-credit` that switches unproven chains between oldest-first (LRU)
    and newest-first (MRU) by the reuse distances it observes. A request frees its blocks as one
    chain; a block of it with no credit (no hit on its identity, no ghost) is unproven. When most
    reuses come after more than `far_factor * num_blocks` frees - the conversation trace's next
    turn comes minutes later - LRU churns every chain out just before it returns, so unproven
    chains go newest first: the cache keeps a stable subset of chains long enough to be reused
    (they then earn credits as in `ghost-credit`). Otherwise the order is `ghost-credit`'s. Reuse
    distances are measured in frees, on hits on free blocks and on ghost returns (content
    evicted, then needed again: its distance is the true one, whatever the policy did), in
    exponentially decayed counts (`decay` per reuse). Unproven MRU blocks rank below every
    credited block; blocks without identity go first."""

    name = "adaptive-credit"
    credit = 1.0
    max_credits = 4
    ghost_factor = 16.0
    ghost_credit = 1
    horizon = 0  # as in ghost-credit
    far_factor = 1.0  # a reuse is far when its distance exceeds far_factor * num_blocks frees
    far_frac = 0.5  # MRU for unproven chains while far reuses are more than this fraction
    decay = 0.999

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        super().__init__(blocks)
        n = len(blocks)
        self._step = self.horizon or self.credit * n
        self.distances = ReuseDistances(self.far_factor * n, self.far_frac, self.decay)
        self.credits = GhostCredits(
            self.hits, max(1, int(self.ghost_factor * n)), self.ghost_credit, on_return=self._ghost_returned
        )

    @property
    def mru(self) -> bool:
        """Whether unproven chains currently go newest first."""
        return self.distances.mostly_far

    def _ghost_returned(self, ghost: Ghost) -> None:
        self.distances.observe(self._seq - ghost.freed_at)

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        mru = self.mru
        base = self._seq
        step, cap = self._step, self.max_credits
        score = self.credits.score
        for block in blocks:
            if block.block_key is None:
                key = -1e18
            else:
                s = min(score(block), cap)
                key = -base if (mru and s == 0) else base + step * s
            self._push(block, key)

    def append(self, block: KVCacheBlock) -> None:
        self.append_n((block,))

    def remove(self, block: KVCacheBlock) -> None:
        freed_at = self.freed_at(block)
        if freed_at and block.block_key is not None:
            self.distances.observe(self._seq - freed_at)
        super().remove(block)

    def on_pop(self, block: KVCacheBlock, freed_at: int) -> None:
        self.credits.evicted(block, freed_at)
