"""One tier as the manager drives it: its store, its counters, its backoff after failures, the
keys a slow tier is known to hold, its background writer, and its KV events (under the medium its
backend registered)."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import replace
from typing import Any

from ..cache import BlockRemoved, BlockStored, KVCacheEvent, KVEventBuffer
from .registry import medium_of
from .stats import TierStats
from .store import KVStore, describe
from .writer import BackgroundWriter

logger = logging.getLogger("prefixkv")

KNOWN_KEYS = 1 << 16  # keys remembered per slow tier as stored (not saved again)
MAX_BACKOFF_S = 30.0
MAX_PENDING_EVENTS = 10_000  # tier events between two engine steps; beyond, the oldest are dropped
# values refused for a MAC that does not verify (a tier secret): one warning per tier per this many
# seconds, with the count since the last one - a planted or foreign store must not flood the log
UNAUTHENTICATED_WARNING_S = 60.0


class EventSink:
    """Tier events waiting for the engine's next step; appended by the engine and writer threads."""

    def __init__(self) -> None:
        self.buffer = KVEventBuffer(MAX_PENDING_EVENTS)
        self.lock = threading.Lock()

    def append(self, event: KVCacheEvent) -> None:
        with self.lock:
            self.buffer.append(event)

    def drain(self) -> list[KVCacheEvent]:
        with self.lock:
            return self.buffer.drain()


class Tier:
    def __init__(self, store: KVStore, max_pending_bytes: int, namespace: bytes) -> None:
        self.store = store
        self.name = store.name
        self.spec = describe(store)
        self.fast = store.fast
        # read on the engine thread at admission (in-memory, or `load=sync`); else on a loader thread
        self.sync_load = store.fast or bool(getattr(store, "sync_load", False))
        self.medium = medium_of(self.name)
        self.namespace = namespace
        self.events: EventSink | None = None  # set when KV events are on
        self.lock = threading.Lock()  # counters are updated by the engine thread and the writer
        self.c = TierStats(self.name, self.spec)  # counters; `available` is set by snapshot()
        self.down_until = 0.0
        self.backoff = 1.0
        self.in_outage = False
        self.unauthenticated_count = 0  # values refused by the MAC since the last warning
        self.unauthenticated_warned = -UNAUTHENTICATED_WARNING_S  # time.monotonic() of that warning
        self.known: OrderedDict[bytes, None] = OrderedDict()  # slow tiers: keys we know are stored
        self.writer: BackgroundWriter | None = None
        if not self.fast:
            self.writer = BackgroundWriter(
                self.name, store.put, self._written, self.up, self._dropped, max_pending_bytes=max_pending_bytes
            )

    def up(self) -> bool:
        return time.monotonic() >= self.down_until

    def add(self, **deltas: Any) -> None:
        """TierStats.add's counters, under the lock."""
        with self.lock:
            self.c.add(**deltas)

    def failed(self, exc: BaseException, doing: str) -> None:
        with self.lock:
            self.c.errors += 1
            self.down_until = time.monotonic() + self.backoff
            self.backoff = min(self.backoff * 2, MAX_BACKOFF_S)
            self.known.clear()  # a store that failed may have lost what it held
            first = not self.in_outage
            self.in_outage = True
        if first:
            logger.warning(
                "KV tier %s failed %s (%s: %s); serving without it (recomputing) and retrying with backoff",
                self.spec,
                doing,
                type(exc).__name__,
                exc,
            )

    def refused_unauthenticated(self) -> None:
        """A value whose MAC did not verify under the tier secret: counted as rejected (by the
        caller) and logged, at most once per UNAUTHENTICATED_WARNING_S per tier."""
        now = time.monotonic()
        with self.lock:
            self.unauthenticated_count += 1
            if now - self.unauthenticated_warned < UNAUTHENTICATED_WARNING_S:
                return
            count, self.unauthenticated_count = self.unauthenticated_count, 0
            self.unauthenticated_warned = now
        logger.warning(
            "KV tier %s: %d value(s) refused: no valid MAC under the tier secret (written without it, with "
            "another secret, or planted); those blocks are computed instead",
            self.spec,
            count,
        )

    def succeeded(self) -> None:
        if self.in_outage:
            with self.lock:
                self.in_outage = False
                self.backoff = 1.0
            logger.warning("KV tier %s answers again", self.spec)

    def _written(
        self, key: bytes, nbytes: int, seconds: float, error: BaseException | None, event: BlockStored | None
    ) -> None:
        if error is not None:
            self.add(saves_dropped=1)
            self.failed(error, "to store a block")
            return
        self.add(saves=1, bytes_saved=nbytes, save_seconds=seconds)
        self.remember(key)
        self.stored(event)
        self.succeeded()

    # -- KV events (medium: this tier's) -------------------------------------------------------
    def stored(self, event: BlockStored | None) -> None:
        if event is not None and self.events is not None:
            self.events.append(replace(event, medium=self.medium))

    def evicted(self, key: bytes) -> None:
        """The store dropped `key` (its LRU bound, or the file is gone): a BlockRemoved if it is ours."""
        ns = self.namespace
        if self.events is not None and key.startswith(ns) and len(key) > len(ns):
            self.events.append(BlockRemoved([key[len(ns) :]], medium=self.medium))

    def _dropped(self) -> None:
        self.add(saves_dropped=1)

    def remember(self, key: bytes) -> None:
        with self.lock:
            known = self.known
            known[key] = None
            known.move_to_end(key)
            if len(known) > KNOWN_KEYS:
                known.popitem(last=False)

    def has(self, key: bytes) -> bool:
        """Stored already (as far as this engine knows): not worth saving again."""
        if self.fast:
            return self.store.contains(key)
        return key in self.known

    def snapshot(self) -> TierStats:
        with self.lock:
            return replace(self.c, available=not self.in_outage)
