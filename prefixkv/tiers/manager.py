"""TierManager: the scheduler-side half of the KV tiers - which blocks to save, which to load.

Saves are write-through: when a block is completed by a forward pass (never when it was a hit),
the scheduler plans "save block id X under key K" into the step's SchedulerOutput; the model
runner copies the block out right after the forward (transfer.py) and hands the value back here,
to be put in the CPU tier at once and queued for the slow tiers (disk, Redis) in background
writers. Loads happen at admission: a request whose prefix misses the pool continues its hash
chain in the tiers (fastest first, a remote tier one round trip per batch of blocks); every hit
value is checked (value.py) and handed to the runner as "load these bytes into block Y" before
the forward. The CPU tier (and a `load=sync` one) is read on the engine thread; the disk and
Redis tiers by default on a loader thread (`start_fetch`) while the request waits and the
scheduler steps the others - a slow store never holds the engine loop. With KV events on, every
tier publishes what it stores and drops under its own `medium` (CPU, DISK, REDIS). A store that
fails (down, full, unwritable) is skipped for a while - exponential backoff, one warning per
outage, counted in the metrics - and the request is simply computed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

import cbor2

from ..cache import BlockRemoved, BlockStored, KVCacheEvent, KVEventBuffer
from .store import KVStore, describe
from .value import authenticated, encode_header, open_value, seal, value_nbytes, without_mac
from .writer import DEFAULT_MAX_PENDING_BYTES, EXIT_FLUSH_S, BackgroundWriter

logger = logging.getLogger("prefixkv")

REMOTE_BATCH = 16  # blocks asked of a slow tier in one round trip
KNOWN_KEYS = 1 << 16  # keys remembered per slow tier as stored (not saved again)
MAX_BACKOFF_S = 30.0
# An asynchronous load not done by then is given up (the blocks are computed) and its tier backs
# off: a store that hangs holds a request this long at most, and the engine loop never.
LOAD_TIMEOUT_S = 5.0
LOAD_THREADS = 2  # loader threads shared by the asynchronous tiers
MAX_PENDING_EVENTS = 10_000  # tier events between two engine steps; beyond, the oldest are dropped
# values refused for a MAC that does not verify (a tier secret): one warning per tier per this many
# seconds, with the count since the last one - a planted or foreign store must not flood the log
UNAUTHENTICATED_WARNING_S = 60.0
# KV events' `medium` per tier: "CPU" is vLLM's offloading connector's name for its CPU tier
MEDIUMS = {"cpu": "CPU", "disk": "DISK", "redis": "REDIS"}

Describe = Callable[[int], BlockStored]  # block index -> its BlockStored event (any medium)


@dataclass(frozen=True, slots=True)
class TierStats:
    """One tier's counters (blocks, bytes, seconds) for metrics."""

    tier: str  # "cpu", "disk", "redis"
    spec: str
    queries: int = 0  # blocks looked up
    hits: int = 0  # blocks found and loaded
    rejected: int = 0  # values found but refused by the checks (corrupted, foreign): counted as misses
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    saves: int = 0  # values written
    bytes_saved: int = 0
    save_seconds: float = 0.0
    saves_dropped: int = 0  # not written: writer queue full or the tier down
    errors: int = 0  # failed store calls
    available: bool = True


class _EventSink:
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


class _Tier:
    def __init__(self, store: KVStore, max_pending_bytes: int, namespace: bytes) -> None:
        self.store = store
        self.name = store.name
        self.spec = describe(store)
        self.fast = store.fast
        # read on the engine thread at admission (in-memory, or `load=sync`); else on a loader thread
        self.sync_load = store.fast or bool(getattr(store, "sync_load", False))
        self.medium = MEDIUMS.get(self.name, self.name.upper())
        self.namespace = namespace
        self.events: _EventSink | None = None  # set when KV events are on
        self.lock = threading.Lock()  # counters are updated by the engine thread and the writer
        self.c: dict[str, Any] = dict(
            queries=0,
            hits=0,
            rejected=0,
            bytes_loaded=0,
            load_seconds=0.0,
            saves=0,
            bytes_saved=0,
            save_seconds=0.0,
            saves_dropped=0,
            errors=0,
        )
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
        with self.lock:
            for k, v in deltas.items():
                self.c[k] += v

    def failed(self, exc: BaseException, doing: str) -> None:
        with self.lock:
            self.c["errors"] += 1
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
            return TierStats(self.name, self.spec, available=not self.in_outage, **self.c)


@dataclass(slots=True)
class KVSave:
    """Copy block `block_id` out after this step's forward and store it under `key`."""

    block_id: int
    key: bytes
    head: bytes  # value header (value.encode_header)
    event: BlockStored | None = None  # with KV events on: the block's event, published per tier once stored


@dataclass(slots=True)
class KVLoad:
    """Copy these (checked) KV bytes into block `block_id` before this step's forward."""

    block_id: int
    kv: memoryview


class TierManager:
    def __init__(
        self,
        stores: Sequence[KVStore],
        namespace: bytes,
        kv_nbytes: int,
        *,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        secret: bytes | None = None,
    ) -> None:
        """`secret`: the tier secret (kv_tier_secret): values are sealed with its MAC and values
        from the disk and Redis tiers must verify (value.py). Kept only here, never logged."""
        if not stores:
            raise ValueError("a tier manager needs at least one store")
        self._secret = secret
        self.namespace = namespace
        self.kv_nbytes = kv_nbytes  # KV bytes of one block, across layers
        self.tiers = [_Tier(s, max_pending_bytes, namespace) for s in stores]
        self.external_queries = 0  # tokens of requests that consulted the tiers (vLLM's meaning)
        self.external_hits = 0  # tokens loaded from the tiers
        self.load_timeout_s = LOAD_TIMEOUT_S
        # values hold the block's stage outputs too (the stage-output cache is on): requests that
        # read stage outputs of their prefix may load it (set by setup.attach_tiers)
        self.carries_stage_outputs = False
        self._load_pool: _DaemonPool | None = None  # started with the first asynchronous load
        self._events: _EventSink | None = None

    def enable_events(self) -> None:
        """Publish tier moves as KV events (BlockStored / BlockRemoved with the tier's medium)."""
        sink = self._events = _EventSink()
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
        found = _walk(
            tiers, keys, _want(token_ids, extras, block_size, last), first, self.kv_nbytes, None, self._secret
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
        want = _want(token_ids, extras, block_size, last)  # copied here, on the engine thread
        keys = [self.key(h) for h in hashes[first:last]]
        fetch.future = self._loader().submit(_walk, tiers, keys, want, first, self.kv_nbytes, fetch, self._secret)
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

    def _promote(self, found: list[_Found], first: int, describe: Describe | None) -> list[memoryview]:
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

    def _loader(self) -> _DaemonPool:
        if self._load_pool is None:
            self._load_pool = _DaemonPool(LOAD_THREADS, "prefixkv-kv-tier-load")
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
        return KVSave(block_id, key, encode_header(key, tokens, _extras_bytes(extras, index)))

    def store(self, save: KVSave, kv: memoryview | bytes) -> None:
        """The block's KV bytes, copied out by the runner: into every tier that lacks them."""
        value = seal(save.head, kv, save.key, self._secret)
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


class _DaemonPool:
    """Loader threads that never hold up the process's exit. ThreadPoolExecutor's workers are
    joined at interpreter exit, so one read that never returns (a hung network mount) kept a
    SIGTERMed server alive forever; these are daemon threads, and `shutdown` only cancels the
    loads not started. A load already running is abandoned (its request was given up on at the
    load deadline)."""

    def __init__(self, num_threads: int, name: str) -> None:
        self._num_threads = num_threads
        self._name = name
        self._threads: list[threading.Thread] = []
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the tier loader is shut down")
            if len(self._threads) < self._num_threads:  # started as needed, as the executor did
                t = threading.Thread(target=self._run, name=f"{self._name}_{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
            self._jobs.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as e:  # noqa: BLE001 (handed to whoever takes the result)
                future.set_exception(e)
            else:
                future.set_result(result)

    def shutdown(self) -> None:
        """Cancel the loads not started and let the threads end; never waits for them."""
        with self._lock:
            self._closed = True
            threads = len(self._threads)
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        for _ in range(threads):
            self._jobs.put(None)


def _extras_bytes(extras: Sequence[Any] | None, index: int) -> bytes | None:
    """The extra keys of blocks 0..index, exactly (None when the request has none)."""
    if not extras:
        return None
    return cbor2.dumps(list(extras[: index + 1]), canonical=True)


@dataclass(frozen=True, slots=True)
class _Want:
    """What a request's values must carry to be loaded (value.py): its prefix tokens and extra keys."""

    tokens: memoryview  # int32 token ids, enough for the last block looked up
    extras: Sequence[Any] | None
    block_size: int


def _want(token_ids: Sequence[int], extras: Sequence[Any] | None, block_size: int, last: int) -> _Want:
    tokens = memoryview(array("i", token_ids[: last * block_size]).tobytes())
    return _Want(tokens, list(extras[:last]) if extras else None, block_size)


_Found = tuple[memoryview, bytes, _Tier, bytes]  # checked KV bytes, the whole value, its tier, its key


class TierFetch:
    """One request's lookup in the asynchronous tiers (blocks `first`..), on a loader thread.
    While it runs the request waits (vLLM's WAITING_FOR_REMOTE_KVS) and holds no block."""

    __slots__ = ("first", "deadline", "future", "tier", "abandoned")

    def __init__(self, first: int, deadline: float) -> None:
        self.first = first
        self.deadline = deadline  # time.monotonic(): past it the load is given up
        self.future: Future[list[_Found]] | None = None
        self.tier: _Tier | None = None  # the tier being asked now (blamed on a timeout)
        self.abandoned = False

    def ready(self) -> bool:
        """Done, or past its deadline (then `take_fetched` gives up on it)."""
        return self.future is None or self.future.done() or time.monotonic() >= self.deadline

    def cancel(self) -> None:
        """The request left (aborted, finished) or no longer needs it: stop at the next block."""
        self.abandoned = True
        if self.future is not None:
            self.future.cancel()


def _walk(
    tiers: Sequence[_Tier],
    keys: Sequence[bytes],
    want: _Want,
    first: int,
    kv_nbytes: int,
    fetch: TierFetch | None = None,
    secret: bytes | None = None,
) -> list[_Found]:
    """Blocks first, first + 1, ... (keys[i - first]) found in `tiers`, asked in order, checked
    (with a tier `secret`, a slow tier's values authenticated first); stops at the first block no
    tier holds. Runs on the engine thread (in-memory and `load=sync` tiers) or a loader thread
    (`fetch`: the others, which never touch the in-memory ones)."""
    found: list[_Found] = []
    batches: dict[int, dict[int, bytes | None]] = {}  # slow tier -> block index -> value
    last = first + len(keys)
    bs = want.block_size
    extras_of: dict[int, bytes | None] = {}  # block index -> its extras bytes (asked per batch and per block)

    def extras(i: int) -> bytes | None:
        if i not in extras_of:
            extras_of[i] = _extras_bytes(want.extras, i)
        return extras_of[i]

    def size(i: int) -> int:
        """The size block i's value must have: a slow store refuses other sizes unread."""
        e = extras(i)
        return value_nbytes(
            len(keys[i - first]),
            len(want.tokens[: (i + 1) * bs * 4]),
            None if e is None else len(e),
            kv_nbytes,
            mac=secret is not None,
        )

    for i in range(first, last):
        if fetch is not None and fetch.abandoned:
            break
        key = keys[i - first]
        want_tokens = want.tokens[: (i + 1) * bs * 4]
        want_extras = extras(i)
        extras_of.pop(i - 1, None)  # blocks before are done with
        hit: _Found | None = None
        for t, tier in enumerate(tiers):
            if not tier.up():
                continue
            if fetch is not None:
                fetch.tier = tier
            t0 = time.perf_counter()
            try:
                if tier.fast:
                    value = tier.store.get(key)
                else:
                    batch = batches.get(t)
                    if batch is None or i not in batch:
                        end = min(last, i + REMOTE_BATCH)
                        values = tier.store.get_many(keys[i - first : end - first], [size(j) for j in range(i, end)])
                        batch = batches[t] = dict(zip(range(i, end), values))
                    value = batch.pop(i)
            except Exception as e:  # noqa: BLE001 (a failing store is a miss, reported)
                tier.failed(e, "a lookup")
                continue
            tier.succeeded()
            seconds = time.perf_counter() - t0
            if value is None:
                tier.add(queries=1, load_seconds=seconds)
                continue
            body: bytes | memoryview = value
            if secret is not None:
                # in-process memory holds only values sealed or authenticated by this engine
                checked = without_mac(value) if tier.fast else authenticated(value, key, secret)
                if checked is None:
                    tier.add(queries=1, rejected=1, load_seconds=time.perf_counter() - t0)
                    tier.refused_unauthenticated()
                    continue
                body = checked
            kv = open_value(body, key, want_tokens, want_extras, kv_nbytes)
            if kv is None:
                tier.add(queries=1, rejected=1, load_seconds=seconds)
                continue
            tier.add(queries=1, hits=1, bytes_loaded=len(value), load_seconds=time.perf_counter() - t0)
            if not tier.fast:
                tier.remember(key)
            hit = (kv, value, tier, key)
            break
        if hit is None:
            break
        found.append(hit)
    if fetch is not None:
        fetch.tier = None
    return found
