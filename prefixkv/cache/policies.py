"""Eviction policies: which free block (ref count 0) is reused next.

A policy owns the set of free blocks. The pool tells it when a block becomes free (`append`,
`append_n` for blocks freed together, given in the order they should go: the tail of a request
first) and when a free block is taken back by a cache hit (`remove`), and asks it for victims
(`popleft`). The pool's callers never see the policy, so policies can be swapped and compared.
"""
from __future__ import annotations

import heapq
from bisect import bisect_left
from collections import OrderedDict
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


class HeapPolicy(EvictionPolicy):
    """Base for policies that rank free blocks by a key computed when the block becomes free:
    the victim is the free block with the smallest `(key, seq)`, where `seq` counts appends, so
    equal keys fall back to the seed's order (least recently freed first, tail of a request
    first). A binary heap with lazy deletion: O(log n) append and pop, O(1) remove; stale entries
    are dropped as they surface and the heap is rebuilt when they outnumber live ones.

    Subclasses define `key(block)` and may use `hits[block_id]`: hits on the block's current
    identity, counted both while it is free (`remove`) and while it is held (`on_hit`, which the
    pool calls only for policies that define it)."""

    name = "heap"
    counts_hits = False

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        n = len(blocks)
        self._blocks = blocks
        self._live = [0] * n  # block id -> seq of its live heap entry, 0 when not free
        self.hits = [0] * n
        self._heap: list[tuple] = [(-1, i + 1, b.block_id) for i, b in enumerate(blocks)]
        self._seq = n
        for i, block in enumerate(blocks):
            self._live[block.block_id] = i + 1
        self._num_free = n
        if self.counts_hits:
            self.on_hit = self._on_hit

    def key(self, block: KVCacheBlock):  # pragma: no cover - abstract in spirit
        return 0

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    def _on_hit(self, block: KVCacheBlock) -> None:
        self.hits[block.block_id] += 1

    def _forget(self, block: KVCacheBlock) -> None:
        """The block is being evicted (it still carries its old identity)."""
        self.hits[block.block_id] = 0

    def popleft(self) -> KVCacheBlock:
        heap, live = self._heap, self._live
        while heap:
            _, seq, bid = heapq.heappop(heap)
            if live[bid] == seq:
                live[bid] = 0
                self._num_free -= 1
                block = self._blocks[bid]
                self._forget(block)  # the block will get a new identity
                return block
        raise ValueError("no free block to pop")

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self._num_free:
            raise ValueError(f"asked for {n} free blocks, {self._num_free} free")
        return [self.popleft() for _ in range(n)]

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self._push(block, self.key(block))

    def remove(self, block: KVCacheBlock) -> None:
        bid = block.block_id
        if not self._live[bid]:
            raise ValueError(f"block {bid} is not in the free queue")
        self._live[bid] = 0
        self._num_free -= 1
        self.hits[bid] += 1

    def append(self, block: KVCacheBlock) -> None:
        self._push(block, self.key(block))

    def _push(self, block: KVCacheBlock, key) -> None:
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


class UnhashedFirstPolicy(HeapPolicy):
    """Free blocks without a cached identity (partial blocks, reserved decode room, evicted
    leftovers) are reused before any cached block; among each group, the seed's LRU order."""

    name = "unhashed-first"

    def key(self, block: KVCacheBlock) -> int:
        return 0 if block.block_hash is None else 1


class LFUPolicy(HeapPolicy):
    """Least frequently used: the free block whose identity was hit the fewest times goes first
    (blocks without identity before all), LRU among equals. Counts restart when a block is
    reused for a new identity."""

    name = "lfu"
    counts_hits = True

    def key(self, block: KVCacheBlock) -> int:
        return -1 if block.block_hash is None else self.hits[block.block_id]


class ReuseCreditPolicy(HeapPolicy):
    """prefixkv's own: LRU in which reuse buys time. Blocks without identity go first; a cached
    block is ranked by when it was freed (the append counter) plus `credit * num_blocks` for each
    hit its identity has had (both while free and while held), at most `max_credits` of them.
    A block that proved reusable thus survives a flood of one-off blocks about `credit` cache
    turnovers longer per reuse, while stale popular blocks still age out (unlike LFU). Within a
    request, tail-first freeing keeps children ahead of parents, as in the seed's order."""

    name = "reuse-credit"
    counts_hits = True
    credit = 1.0
    max_credits = 4

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        super().__init__(blocks)
        self._step = self.credit * len(blocks)

    def key(self, block: KVCacheBlock) -> float:
        if block.block_hash is None:
            return -1
        return self._seq + self._step * min(self.hits[block.block_id], self.max_credits)


class GhostCreditPolicy(ReuseCreditPolicy):
    """prefixkv's own: `reuse-credit` that also remembers what it evicted. A bounded ghost table
    (`ghost_factor * num_blocks` entries, FIFO; 16 by default, since reuse distances in the
    Mooncake traces are many cache turnovers long) keeps, for each evicted identity, the credits it
    had; when the same content is computed and cached again, the block starts with those credits
    plus one for the reuse the cache missed. So a block that proved reusable once - even if the
    reuse came after it was evicted, the common case when reuse distances exceed the cache - is
    protected from the next flood of one-off blocks. Ghosts are keyed by the block's content (its
    token tuple and extra keys; the parent is left out because its identity number changes when
    it is re-cached), so a ghost can only mis-rank a block, never serve a hit."""

    name = "ghost-credit"
    ghost_factor = 16.0
    ghost_credit = 1
    horizon = 0  # if > 0: appends of extra life per credit, instead of credit * num_blocks

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        super().__init__(blocks)
        n = len(blocks)
        self._ghosts: OrderedDict[int, int] = OrderedDict()
        self._ghost_cap = max(1, int(self.ghost_factor * n))
        self._bonus: list[int | None] = [None] * n  # credits inherited by the current identity
        if self.horizon:
            self._step = self.horizon

    @staticmethod
    def ghost_key(block: KVCacheBlock) -> int:
        key = block.block_hash
        return hash(key[1:])  # (tokens, extra keys) of an exact key

    def _score(self, block: KVCacheBlock) -> int:
        bid = block.block_id
        bonus = self._bonus[bid]
        if bonus is None:
            prior = self._ghosts.pop(self.ghost_key(block), None)
            bonus = self._bonus[bid] = 0 if prior is None else prior + self.ghost_credit
        return self.hits[bid] + bonus

    def key(self, block: KVCacheBlock) -> float:
        if block.block_hash is None:
            return -1
        return self._seq + self._step * min(self._score(block), self.max_credits)

    def _forget(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            ghosts = self._ghosts
            ghosts[self.ghost_key(block)] = self._score(block)
            if len(ghosts) > self._ghost_cap:
                ghosts.popitem(last=False)
        self._bonus[block.block_id] = None
        self.hits[block.block_id] = 0


class AdaptiveCreditPolicy(GhostCreditPolicy):
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
    far_factor = 1.0  # a reuse is far when its distance exceeds far_factor * num_blocks frees
    far_frac = 0.5  # MRU for unproven chains while far reuses are more than this fraction
    decay = 0.999

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        super().__init__(blocks)
        self._fseq = [0] * len(blocks)  # seq at which the block was last freed
        self._far_limit = self.far_factor * len(blocks)
        self._far = self._near = 0.0

    @property
    def mru(self) -> bool:
        """Whether unproven chains currently go newest first."""
        return self._far > self.far_frac * (self._far + self._near)

    def _reuse(self, distance: int) -> None:
        d = self.decay
        if distance > self._far_limit:
            self._far = self._far * d + 1.0
            self._near *= d
        else:
            self._near = self._near * d + 1.0
            self._far *= d

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        mru = self.mru
        base = self._seq
        step, cap = self._step, self.max_credits
        for block in blocks:
            if block.block_hash is None:
                key = -1e18
            else:
                score = min(self._score(block), cap)
                key = -base if (mru and score == 0) else base + step * score
            self._push(block, key)

    def append(self, block: KVCacheBlock) -> None:
        self.append_n((block,))

    def _push(self, block: KVCacheBlock, key) -> None:
        super()._push(block, key)
        self._fseq[block.block_id] = self._seq

    def remove(self, block: KVCacheBlock) -> None:
        bid = block.block_id
        if self._live[bid] and block.block_hash is not None:
            self._reuse(self._seq - self._fseq[bid])
        super().remove(block)

    def _score(self, block: KVCacheBlock) -> int:
        bid = block.block_id
        bonus = self._bonus[bid]
        if bonus is None:
            prior = self._ghosts.pop(self.ghost_key(block), None)
            if prior is None:
                bonus = 0
            else:
                score, fseq, *extra = prior
                self._reuse(self._seq - fseq)
                self._ghost_returned(extra)
                bonus = score + self.ghost_credit
            self._bonus[bid] = bonus
        return self.hits[bid] + bonus

    def _ghost_extra(self, bid: int) -> tuple:
        """What a subclass keeps in a ghost beside its credits and free time."""
        return ()

    def _ghost_returned(self, extra: list) -> None:
        """The content of a ghost was cached again; `extra` is what _ghost_extra kept."""

    def _forget(self, block: KVCacheBlock) -> None:
        bid = block.block_id
        if block.block_hash is not None:
            ghosts = self._ghosts
            ghosts[self.ghost_key(block)] = (self._score(block), self._fseq[bid], *self._ghost_extra(bid))
            if len(ghosts) > self._ghost_cap:
                ghosts.popitem(last=False)
        self._bonus[bid] = None
        self.hits[bid] = 0


class PredictedReusePolicy(AdaptiveCreditPolicy):
    """prefixkv's own: learns online which freed blocks come back, and keeps those longer.

    Every time a cached block is freed it falls in a class, and the policy counts, per class, how
    many blocks it freed and how many of them were reused later (a hit while free, or the same
    content computed again after eviction: a ghost return). A block's extra life after its free
    is `life * num_blocks` appends times its class's observed reuse rate, so classes that rarely
    come back are evicted first and a class that proves reusable earns room as it does. Classes
    use what the engine knows when a request finishes (`on_request_free`): for an unproven block
    (no hit, no ghost credit) its request's output length, how many of the request's blocks are
    new, how far from the chain's tail the block lies, and whether the request hit the cache at
    all; for a proven one its credit count and the output length. (On the Mooncake synthetic
    trace, new blocks of short-answer requests return ~90% of the time, those of long-answer
    ones under 10%.) No block is ranked above its parent. While reuses are mostly far (see
    `adaptive-credit`), unproven chains go newest first, each shifted by its predicted value.
    Rates start at the global rate (`prior_weight` pseudo-counts); blocks without identity go
    first."""

    name = "predicted-reuse"
    life = 8.0  # extra life, in num_blocks appends, of a block whose class always returns
    prior_weight = 4.0
    # Bucket edges (bisect_left: bucket i holds values <= edges[i]; one more bucket above).
    OUTPUT_EDGES = (5, 20, 100, 300, 1000)  # output tokens of the request
    NEW_EDGES = (1, 2, 4, 8, 16, 64)  # blocks the request computed (no hit, no ghost credit)
    TAIL_EDGES = (0, 1, 3, 7, 15, 63)  # the block's distance from the chain's tail
    N_OUT, N_NEW, N_TAIL = len(OUTPUT_EDGES) + 1, len(NEW_EDGES) + 1, len(TAIL_EDGES) + 1
    # Unproven classes are (request hit anything, output, new blocks, tail distance); proven
    # ones (credits, output) come after them.
    _UNPROVEN = 2 * N_OUT * N_NEW * N_TAIL

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        super().__init__(blocks)
        n_classes = self._UNPROVEN + self.max_credits * self.N_OUT
        self._freed = [0.0] * n_classes
        self._reused = [0.0] * n_classes
        self._all_freed = self._all_reused = 0
        self._cls = [-1] * len(blocks)  # class of the block's last free; -1 if none
        self._life = self.life * len(blocks)
        self._output_bucket = 0

    def on_request_free(self, num_prompt_tokens: int, num_output_tokens: int) -> None:
        self._output_bucket = bisect_left(self.OUTPUT_EDGES, num_output_tokens)

    def _rate(self, cls: int) -> float:
        prior = self._all_reused / (self._all_freed or 1)
        w = self.prior_weight
        return (self._reused[cls] + w * prior) / (self._freed[cls] + w)

    def _count_reuse(self, cls: int) -> None:
        if cls >= 0:
            self._reused[cls] += 1
            self._all_reused += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        blocks = list(blocks)  # tail first: the parent of blocks[i] is blocks[i + 1]
        cap = self.max_credits
        scores = [-1 if b.block_hash is None else min(self._score(b), cap) for b in blocks]
        num_new = scores.count(0)
        hit_any = 1 if num_new < len(scores) - scores.count(-1) else 0
        out = self._output_bucket
        unproven = ((hit_any * self.N_OUT + out) * self.N_NEW
                    + bisect_left(self.NEW_EDGES, num_new)) * self.N_TAIL
        mru, base = self.mru, self._seq
        keys = []
        j = 0
        for block, score in zip(blocks, scores):
            bid = block.block_id
            if score < 0:
                self._cls[bid] = -1
                keys.append(-1e18)
                continue
            if score == 0:
                cls = unproven + bisect_left(self.TAIL_EDGES, j)
            else:
                cls = self._UNPROVEN + (score - 1) * self.N_OUT + out
            j += 1
            self._cls[bid] = cls
            self._freed[cls] += 1
            self._all_freed += 1
            value = self._life * self._rate(cls)
            keys.append((-base if mru and score == 0 else base) + value)
        # A block is worth nothing without its prefix: never rank one above its parent.
        for i in range(len(keys) - 2, -1, -1):
            if keys[i] > keys[i + 1] > -1e18:
                keys[i] = keys[i + 1]
        for block, key in zip(blocks, keys):
            self._push(block, key)

    def remove(self, block: KVCacheBlock) -> None:
        if self._live[block.block_id]:
            self._count_reuse(self._cls[block.block_id])
        super().remove(block)

    def _ghost_extra(self, bid: int) -> tuple:
        return (self._cls[bid],)

    def _ghost_returned(self, extra: list) -> None:
        self._count_reuse(extra[0])

    def _forget(self, block: KVCacheBlock) -> None:
        super()._forget(block)
        self._cls[block.block_id] = -1


POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
    "unhashed-first": UnhashedFirstPolicy,
    "lfu": LFUPolicy,
    "reuse-credit": ReuseCreditPolicy,
    "ghost-credit": GhostCreditPolicy,
    "adaptive-credit": AdaptiveCreditPolicy,
    "predicted-reuse": PredictedReusePolicy,
}


def register_policy(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """Class decorator: make a policy available by its `name` (e.g. to KVCacheManager)."""
    POLICIES[cls.name] = cls
    return cls


def get_policy(name: str | type[EvictionPolicy]) -> type[EvictionPolicy]:
    if isinstance(name, type) and issubclass(name, EvictionPolicy):
        return name
    try:
        return POLICIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(POLICIES)}") from None
