"""prefixkv's predicted-reuse policy: learns online which freed blocks come back."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable

from ..block import KVCacheBlock
from .credit import Ghost, GhostCredits, ReuseDistances
from .heap import HeapPolicy


class ReuseRates:
    """Per class: how many blocks were freed and how many of them were reused later; the rate is
    smoothed toward the global rate with `prior_weight` pseudo-counts."""

    def __init__(self, num_classes: int, prior_weight: float) -> None:
        self.freed = [0.0] * num_classes
        self.reused = [0.0] * num_classes
        self.all_freed = self.all_reused = 0
        self.prior_weight = prior_weight

    def count_free(self, cls: int) -> None:
        self.freed[cls] += 1
        self.all_freed += 1

    def count_reuse(self, cls: int) -> None:
        if cls >= 0:
            self.reused[cls] += 1
            self.all_reused += 1

    def rate(self, cls: int) -> float:
        prior = self.all_reused / (self.all_freed or 1)
        w = self.prior_weight
        return (self.reused[cls] + w * prior) / (self.freed[cls] + w)


class PredictedReusePolicy(HeapPolicy):
    """prefixkv's own: learns online which freed blocks come back, and keeps those longer.

    Every time a cached block is freed it falls in a class, and the policy counts, per class, how
    many blocks it freed and how many of them were reused later (a hit while free, or the same
    content computed again after eviction: a ghost return, see GhostCredits). A block's extra life
    after its free is `life * num_blocks` appends times its class's observed reuse rate, so classes
    that rarely come back are evicted first and a class that proves reusable earns room as it
    does. Classes use what the engine knows when a request finishes (`on_request_free`): for an
    unproven block (no hit, no ghost credit) its request's output length, how many of the
    request's blocks are new, how far from the chain's tail the block lies, and whether the
    request hit the cache at all; for a proven one its credit count and the output length. (On
    the Mooncake synthetic trace, new blocks of short-answer requests return ~90% of the time,
    those of long-answer ones under 10%.) No block is ranked above its parent. While reuses are
    mostly far (ReuseDistances, as in `adaptive-credit`), unproven chains go newest first, each
    shifted by its predicted value. Rates start at the global rate (`prior_weight` pseudo-counts);
    blocks without identity go first."""

    name = "predicted-reuse"
    life = 8.0  # extra life, in num_blocks appends, of a block whose class always returns
    prior_weight = 4.0
    max_credits = 4
    ghost_factor = 16.0
    ghost_credit = 1
    far_factor = 1.0
    far_frac = 0.5
    decay = 0.999
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
        n = len(blocks)
        self.distances = ReuseDistances(self.far_factor * n, self.far_frac, self.decay)
        self.credits = GhostCredits(
            self.hits, max(1, int(self.ghost_factor * n)), self.ghost_credit, on_return=self._ghost_returned
        )
        self.rates = ReuseRates(self._UNPROVEN + self.max_credits * self.N_OUT, self.prior_weight)
        self._cls = [-1] * n  # class of the block's last free; -1 if none
        self._life = self.life * n
        self._output_bucket = 0

    @property
    def mru(self) -> bool:
        """Whether unproven chains currently go newest first."""
        return self.distances.mostly_far

    def on_request_free(self, num_prompt_tokens: int, num_output_tokens: int) -> None:
        self._output_bucket = bisect_left(self.OUTPUT_EDGES, num_output_tokens)

    def _ghost_returned(self, ghost: Ghost) -> None:
        self.distances.observe(self._seq - ghost.freed_at)
        self.rates.count_reuse(ghost.cls)

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        blocks = list(blocks)  # tail first: the parent of blocks[i] is blocks[i + 1]
        cap = self.max_credits
        score = self.credits.score
        scores = [-1 if b.block_key is None else min(score(b), cap) for b in blocks]
        num_new = scores.count(0)
        hit_any = 1 if num_new < len(scores) - scores.count(-1) else 0
        out = self._output_bucket
        unproven = ((hit_any * self.N_OUT + out) * self.N_NEW + bisect_left(self.NEW_EDGES, num_new)) * self.N_TAIL
        mru, base = self.mru, self._seq
        rates = self.rates
        keys: list[float] = []
        j = 0
        for block, s in zip(blocks, scores):
            bid = block.block_id
            if s < 0:
                self._cls[bid] = -1
                keys.append(-1e18)
                continue
            if s == 0:
                cls = unproven + bisect_left(self.TAIL_EDGES, j)
            else:
                cls = self._UNPROVEN + (s - 1) * self.N_OUT + out
            j += 1
            self._cls[bid] = cls
            rates.count_free(cls)
            value = self._life * rates.rate(cls)
            keys.append((-base if mru and s == 0 else base) + value)
        # A block is worth nothing without its prefix: never rank one above its parent.
        for i in range(len(keys) - 2, -1, -1):
            if keys[i] > keys[i + 1] > -1e18:
                keys[i] = keys[i + 1]
        for block, key in zip(blocks, keys):
            self._push(block, key)

    def append(self, block: KVCacheBlock) -> None:
        self.append_n((block,))

    def remove(self, block: KVCacheBlock) -> None:
        freed_at = self.freed_at(block)
        if freed_at:
            self.rates.count_reuse(self._cls[block.block_id])
            if block.block_key is not None:
                self.distances.observe(self._seq - freed_at)
        super().remove(block)

    def on_pop(self, block: KVCacheBlock, freed_at: int) -> None:
        self.credits.evicted(block, freed_at, self._cls[block.block_id])
        self._cls[block.block_id] = -1
