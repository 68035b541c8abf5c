"""TierManager: the tiers below the pool as one ordered list - which blocks they hold, what to
save, what to load - under the engine's namespace.

Saves are write-through: when a block is completed by a forward pass (never when it was a hit),
the scheduler half plans "save block id X under key K" (`plan_save`); the worker half copies the
block out right after the forward and seals it, and the value comes back here (`store`), to be put
in the CPU tier at once and queued for the slow tiers (disk, Redis) in background writers. Loads
happen at admission: a request whose prefix misses the pool continues its hash chain in the tiers
(fastest first, a remote tier one round trip per batch of blocks, lookup.py); every hit value is
checked (value.py) and handed to the worker half as "load these bytes into block Y" before the
forward. The CPU tier (and a `load=sync` one) is read on the engine thread; the disk and Redis
tiers by default on a loader thread (`start_fetch`) while the request waits and the scheduler
steps the others - a slow store never holds the engine loop. With KV events on, every tier
publishes what it stores and drops under its own `medium`. A store that fails (down, full,
unwritable) is skipped for a while - exponential backoff, one warning per outage, counted in the
metrics - and the request is simply computed.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Callable, Sequence
from typing import Any

from ..cache import BlockStored, KVCacheEvent
from .loader import DaemonPool
from .lookup import Found, TierFetch, extras_bytes, walk, want_of
from .plans import KVLoad, KVSave, SavedBlock
from .stats import TierStats
from .store import KVStore
from .tier import EventSink, Tier
from .value import encode_header, seal
from .writer import DEFAULT_MAX_PENDING_BYTES, EXIT_FLUSH_S

logger = logging.getLogger("prefixkv")

# An asynchronous load not done by then is given up (the blocks are computed) and its tier backs
# off: a store that hangs holds a request this long at most, and the engine loop never.
LOAD_TIMEOUT_S = 5.0
LOAD_THREADS = 2  # loader threads shared by the asynchronous tiers

Describe = Callable[[int], BlockStored]  # block index -> its BlockStored event (any medium)


class TierManager:
    def __init__(
        self,
        stores: Sequence[KVStore],
        namespace: bytes,
        kv_nbytes: int,
        *,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        secret: bytes | None = None,
        kv_events: bool = False,
        carries_stage_outputs: bool = False,
    ) -> None:
        """`secret`: the tier secret (kv_tier_secret): values from the disk and Redis tiers must
        verify under it (value.py; the worker half seals them). Never logged. `kv_events`: publish
        tier moves as KV events (BlockStored / BlockRemoved with each tier's medium).
        `carries_stage_outputs`: values hold the block's stage outputs too (the stage-output cache
        is on), so requests that read stage outputs of their prefix may load it."""
        if not stores:
            raise ValueError("a tier manager needs at least one store")
        self._secret = secret
        self.namespace = namespace
        self.kv_nbytes = kv_nbytes  # KV bytes of one block, across layers
        self.tiers = [Tier(s, max_pending_bytes, namespace) for s in stores]
        self.external_queries = 0  # tokens of requests that consulted the tiers (vLLM's meaning)
        self.external_hits = 0  # tokens loaded from the tiers
        self.load_timeout_s = LOAD_TIMEOUT_S
        self.carries_stage_outputs = carries_stage_outputs
        self._load_pool: DaemonPool | None = None  # started with the first asynchronous load
        self._events: EventSink | None = None
        if kv_events:
            self._enable_events()

    def _enable_events(self) -> None:
        sink = self._events = EventSink()
        for tier in self.tiers:
            tier.events = sink
            if hasattr(tier.store, "on_evict"):
                tier.store.on_evict = tier.evicted

    @property
    def events_enabled(self) -> bool:
        return self._events is not None

    def take_events(self) -> list[KVCacheEvent]:
        return self._events.drain() if self._events is not None else []

    def key(self, content_hash: bytes) -> bytes:
        return self.namespace + content_hash

    # -- load ----------------------------------------------------------------------------------
    @property
    def has_async_tiers(self) -> bool:
        return any(not t.sync_load for t in self.tiers)

    def lookup(
        self,
        hashes: Sequence[bytes],
        token_ids: Sequence[int],
        extras: Sequence[Any] | None,
        block_size: int,
        first: int,
        last: int,
        describe: Describe | None = None,
        *,
        sync_only: bool = False,
    ) -> list[memoryview]:
        """KV bytes of blocks first, first + 1, ... (< last) found in the tiers, stopping at the
        first block that no tier holds (a chain is only useful without gaps). With `sync_only`,
        only the tiers loaded on the engine thread (the CPU tier, `load=sync` ones) are asked.
        `describe(i)`: block i's BlockStored event, for blocks promoted into the CPU tier."""
        if first >= last:
            return []
        tiers = [t for t in self.tiers if t.sync_load] if sync_only else self.tiers
        keys = [self.key(h) for h in hashes[first:last]]
        found = walk(
            tiers, keys, want_of(token_ids, extras, block_size, last), first, self.kv_nbytes, None, self._secret
        )
        return self._promote(found, first, describe)

    def start_fetch(
        self,
        hashes: Sequence[bytes],
        token_ids: Sequence[int],
        extras: Sequence[Any] | None,
        block_size: int,
        first: int,
        last: int,
    ) -> TierFetch | None:
        """Look blocks first.. (< last) up in the asynchronous tiers on a loader thread (values
        read and checked there); None when none of them is up. The engine thread polls the
        fetch (`TierFetch.ready`) and takes its blocks with `take_fetched`."""
        tiers = [t for t in self.tiers if not t.sync_load and t.up()]
        if first >= last or not tiers:
            return None
        fetch = TierFetch(first, time.monotonic() + self.load_timeout_s)
        want = want_of(token_ids, extras, block_size, last)  # copied here, on the engine thread
        keys = [self.key(h) for h in hashes[first:last]]
        fetch.future = self._loader().submit(walk, tiers, keys, want, first, self.kv_nbytes, fetch, self._secret)
        return fetch

    def take_fetched(self, fetch: TierFetch, first: int, describe: Describe | None = None) -> list[memoryview]:
        """The blocks of a ready fetch from block `first` on ([] when it does not reach it, failed
        or timed out: those blocks are computed). Hits are promoted into the CPU tier here, on the
        engine thread, which owns it."""
        future = fetch.future
        assert future is not None
        if not future.done():  # past its deadline: the store hangs; give up on it for a while
            fetch.cancel()
            tier = fetch.tier
            if tier is not None:
                tier.failed(TimeoutError(f"no answer in {self.load_timeout_s:g} s"), "an asynchronous load")
            return []
        found = future.result()
        skip = first - fetch.first
        if skip < 0 or skip >= len(found):
            return []
        return self._promote(found[skip:], first, describe)

    def _promote(self, found: list[Found], first: int, describe: Describe | None) -> list[memoryview]:
        """Put blocks found in a slower tier into the in-memory tiers before it (which missed them)."""
        out = []
        for i, (kv, value, tier, key) in enumerate(found):
            out.append(kv)
            for faster in self.tiers:  # the walk asks tiers in order: the in-memory ones before missed
                if faster is tier:
                    break
                if faster.fast and faster.up() and not faster.store.contains(key):
                    faster.store.put(key, value)
                    if describe is not None and faster.events is not None:
                        faster.stored(describe(first + i))
        return out

    def _loader(self) -> DaemonPool:
        if self._load_pool is None:
            self._load_pool = DaemonPool(LOAD_THREADS, "prefixkv-kv-tier-load")
        return self._load_pool

    @staticmethod
    def load_plan(block_ids: Sequence[int], loaded: Sequence[memoryview]) -> list[KVLoad]:
        return [KVLoad(b, kv) for b, kv in zip(block_ids, loaded)]

    def record_query(self, num_tokens: int, num_loaded_tokens: int) -> None:
        self.external_queries += num_tokens
        self.external_hits += num_loaded_tokens

    # -- save ----------------------------------------------------------------------------------
    def plan_save(
        self,
        block_id: int,
        content_hash: bytes,
        token_ids: Sequence[int],
        extras: Sequence[Any] | None,
        block_size: int,
        index: int,
    ) -> KVSave | None:
        """A save of block `index` of a request (held in `block_id`), or None when every tier
        has it already or none is up."""
        key = self.key(content_hash)
        if all(tier.has(key) or not tier.up() for tier in self.tiers):
            return None
        tokens = array("i", token_ids[: (index + 1) * block_size]).tobytes()
        return KVSave(block_id, key, encode_header(key, tokens, extras_bytes(extras, index)))

    def seal(self, save: KVSave, kv_bytes: bytes) -> SavedBlock:
        """A block's value sealed here as the worker half seals the others: a block copied out
        before its hash was known, planned (`plan_save`) once it is (KVSave.owner)."""
        return SavedBlock(save, seal(save.head, kv_bytes, save.key, self._secret))

    def store(self, saved: SavedBlock) -> None:
        """A block's value, sealed by the worker half: into every tier that lacks it."""
        save, value = saved.save, saved.value
        for tier in self.tiers:
            if tier.has(save.key) or not tier.up():
                continue
            if tier.writer is None:
                t0 = time.perf_counter()
                try:
                    tier.store.put(save.key, value)
                except Exception as e:  # noqa: BLE001 (reported; the step goes on)
                    tier.failed(e, "to store a block")
                    continue
                tier.add(saves=1, bytes_saved=len(value), save_seconds=time.perf_counter() - t0)
                tier.stored(save.event)
            elif not tier.writer.submit(save.key, value, save.event):
                tier.add(saves_dropped=1)

    # -- life ----------------------------------------------------------------------------------
    def retry_now(self) -> None:
        """Forget the backoff of failed tiers: the next lookup or save tries them again."""
        for tier in self.tiers:
            tier.down_until = 0.0

    def writes_pending(self) -> bool:
        """Whether a background writer still has saves to make (each adds its KV event when done)."""
        return any(tier.writer is not None and tier.writer.pending for tier in self.tiers)

    def flush(self) -> None:
        """Wait until every queued save reached its store (or was dropped)."""
        for tier in self.tiers:
            if tier.writer is not None:
                tier.writer.flush()

    def close(self) -> None:
        if self._load_pool is not None:
            self._load_pool.shutdown()
        for tier in self.tiers:
            if tier.writer is not None:
                # bounded: a store that hangs (a hung mount) must not hold the shutdown
                if not tier.writer.flush(EXIT_FLUSH_S):
                    logger.warning(
                        "KV tier %s: %d value(s) still queued after %g s at close; not stored",
                        tier.spec,
                        tier.writer.pending,
                        EXIT_FLUSH_S,
                    )
                tier.writer.close()
            try:
                tier.store.close()
            except Exception:  # noqa: BLE001 (closing a broken connection)
                pass

    def stats(self) -> tuple[TierStats, ...]:
        return tuple(tier.snapshot() for tier in self.tiers)
