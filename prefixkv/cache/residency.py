"""Block residency, sampled: how long cached blocks live, how long they sit unused before they are
evicted, and how far apart their reuses are - the figures an operator sizes a cache and picks an
eviction policy by (vLLM's --kv-cache-metrics: kv_block_lifetime_seconds,
kv_block_idle_before_evict_seconds, kv_block_reuse_gap_seconds).

A sampled share of the allocated blocks is followed (`sample_rate`, vLLM's 0.01 by default), so
the pool's per-block work stays a dict lookup for the few it follows; the pool calls in only
when the metrics are on, once per call of its own (never per block on the default path).
Evictions are counted for every block, by cause: "capacity" (reused for new content),
"unreachable" (content that can never be hit again: an unloaded adapter's), "reset"
(reset_prefix_cache).

Besides vLLM's seconds, a reuse gap is also measured in blocks allocated in between: the reuse
distance, which says directly how many blocks a cache needs for the reuse to hit.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from .block import KVCacheBlock

EVICTION_CAUSES = ("capacity", "unreachable", "reset")


@dataclass
class _Followed:
    born: float
    last_use: float
    last_use_clock: int


@dataclass
class ResidencyObservations:
    """Observations since the last take: seconds (lifetimes, idle times, reuse gaps) and reuse
    distances in allocated blocks."""

    lifetime_s: list[float] = field(default_factory=list)
    idle_before_evict_s: list[float] = field(default_factory=list)
    reuse_gap_s: list[float] = field(default_factory=list)
    reuse_distance_blocks: list[int] = field(default_factory=list)


class ResidencyMetrics:
    """Sampled residency of a pool's blocks (see the module doc). `max_pending` bounds the
    observations kept between takes (the oldest are dropped)."""

    def __init__(
        self,
        sample_rate: float = 0.01,
        clock: Callable[[], float] = time.monotonic,
        seed: int | None = None,
        max_pending: int = 10_000,
    ) -> None:
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"kv_cache_metrics_sample must be in (0, 1], got {sample_rate}")
        self.sample_rate = sample_rate
        self._clock = clock
        self._random = random.Random(seed).random
        self._followed: dict[int, _Followed] = {}  # block id -> its residency
        self._allocated = 0  # blocks allocated so far: the clock reuse distances are read on
        self.evictions = dict.fromkeys(EVICTION_CAUSES, 0)
        self._lifetime: deque[float] = deque(maxlen=max_pending)
        self._idle: deque[float] = deque(maxlen=max_pending)
        self._gap: deque[float] = deque(maxlen=max_pending)
        self._distance: deque[int] = deque(maxlen=max_pending)

    @property
    def num_followed(self) -> int:
        return len(self._followed)

    # -- called by the pool --------------------------------------------------------------------
    def on_allocate(self, blocks: list[KVCacheBlock]) -> None:
        """`blocks` leave the free set for new content; those still cached are evicted."""
        now = self._clock()
        evicted = 0
        followed, rate, draw = self._followed, self.sample_rate, self._random
        for block in blocks:
            if block.block_key is not None:
                evicted += 1
            state = followed.pop(block.block_id, None)
            if state is not None and block.block_key is not None:
                self._evicted(state, now)
            if rate >= 1.0 or draw() < rate:
                followed[block.block_id] = _Followed(now, now, self._allocated)
        self._allocated += len(blocks)
        self.evictions["capacity"] += evicted

    def on_access(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Cache hits on `blocks`: a reuse of each."""
        for state, now in self._touched(blocks):
            self._gap.append(now - state.last_use)
            self._distance.append(self._allocated - state.last_use_clock)
            state.last_use, state.last_use_clock = now, self._allocated

    def on_release(self, blocks: Iterable[KVCacheBlock]) -> None:
        """`blocks` were freed by their last holder: their idle time starts now."""
        for state, now in self._touched(blocks):
            state.last_use, state.last_use_clock = now, self._allocated

    def _touched(self, blocks: Iterable[KVCacheBlock]) -> Iterator[tuple[_Followed, float]]:
        """The followed ones among `blocks`, with the time (read once, and only if one is)."""
        followed = self._followed
        if not followed:
            return
        now = None
        for block in blocks:
            state = followed.get(block.block_id)
            if state is not None:
                now = self._clock() if now is None else now
                yield state, now

    def on_evict(self, blocks: Iterable[KVCacheBlock], cause: str) -> None:
        """`blocks` lost their identity for `cause` (not "capacity": on_allocate counts that)."""
        now = self._clock()
        n = 0
        for block in blocks:
            n += 1
            state = self._followed.pop(block.block_id, None)
            if state is not None:
                self._evicted(state, now)
        self.evictions[cause] += n

    def _evicted(self, state: _Followed, now: float) -> None:
        self._lifetime.append(now - state.born)
        self._idle.append(now - state.last_use)

    # -- read by the engine's stats ------------------------------------------------------------
    def take(self) -> ResidencyObservations:
        """The observations since the last take (drained)."""
        out = ResidencyObservations(list(self._lifetime), list(self._idle), list(self._gap), list(self._distance))
        for pending in (self._lifetime, self._idle, self._gap, self._distance):
            pending.clear()
        return out
