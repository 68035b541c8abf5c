"""TierManager: the scheduler-side half of the KV tiers - which blocks to save, which to load.

Saves are write-through: when a block is completed by a forward pass (never when it was a hit),
the scheduler plans "save block id X under key K" into the step's SchedulerOutput; the model
runner copies the block out right after the forward (transfer.py) and hands the value back here,
to be put in the CPU tier at once and queued for the slow tiers (disk, Redis) in background
writers. Loads happen at admission: a request whose prefix misses the pool continues its hash
chain in the tiers (fastest first, a remote tier one round trip per batch of blocks); every hit
value is checked (value.py) and handed to the runner as "load these bytes into block Y" before
the forward. A store that fails (down, full, unwritable) is skipped for a while - exponential
backoff, one warning per outage, counted in the metrics - and the request is simply computed.
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import cbor2

from .store import KVStore, describe
from .value import encode_header, open_value, seal
from .writer import DEFAULT_MAX_PENDING_BYTES, BackgroundWriter

logger = logging.getLogger("prefixkv")

REMOTE_BATCH = 16  # blocks asked of a slow tier in one round trip
KNOWN_KEYS = 1 << 16  # keys remembered per slow tier as stored (not saved again)
MAX_BACKOFF_S = 30.0


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


class _Tier:
    def __init__(self, store: KVStore, max_pending_bytes: int) -> None:
        self.store = store
        self.name = store.name
        self.spec = describe(store)
        self.fast = store.fast
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

    def succeeded(self) -> None:
        if self.in_outage:
            with self.lock:
                self.in_outage = False
                self.backoff = 1.0
            logger.warning("KV tier %s answers again", self.spec)

    def _written(self, key: bytes, nbytes: int, seconds: float, error: BaseException | None) -> None:
        if error is not None:
            self.add(saves_dropped=1)
            self.failed(error, "to store a block")
            return
        self.add(saves=1, bytes_saved=nbytes, save_seconds=seconds)
        self.remember(key)
        self.succeeded()

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
    ) -> None:
        if not stores:
            raise ValueError("a tier manager needs at least one store")
        self.namespace = namespace
        self.kv_nbytes = kv_nbytes  # KV bytes of one block, across layers
        self.tiers = [_Tier(s, max_pending_bytes) for s in stores]
        self.external_queries = 0  # tokens of requests that consulted the tiers (vLLM's meaning)
        self.external_hits = 0  # tokens loaded from the tiers

    def key(self, content_hash: bytes) -> bytes:
        return self.namespace + content_hash

    # -- load ----------------------------------------------------------------------------------
    def lookup(
        self,
        hashes: Sequence[bytes],
        token_ids: Sequence[int],
        extras: Sequence[Any] | None,
        block_size: int,
        first: int,
        last: int,
    ) -> list[memoryview]:
        """KV bytes of blocks first, first + 1, ... (< last) found in the tiers, stopping at the
        first block that no tier holds (a chain is only useful without gaps)."""
        if first >= last:
            return []
        tokens = memoryview(array("i", token_ids[: last * block_size]).tobytes())
        found: list[memoryview] = []
        batches: dict[int, dict[int, bytes | None]] = {}  # slow tier -> block index -> value
        for i in range(first, last):
            key = self.key(hashes[i])
            want_tokens = tokens[: (i + 1) * block_size * 4]
            want_extras = _extras_bytes(extras, i)
            kv = None
            missed: list[_Tier] = []
            for t, tier in enumerate(self.tiers):
                if not tier.up():
                    continue
                t0 = time.perf_counter()
                try:
                    if tier.fast:
                        value = tier.store.get(key)
                    else:
                        batch = batches.get(t)
                        if batch is None or i not in batch:
                            end = min(last, i + REMOTE_BATCH)
                            values = tier.store.get_many([self.key(hashes[j]) for j in range(i, end)])
                            batch = batches[t] = dict(zip(range(i, end), values))
                        value = batch.pop(i)
                except Exception as e:  # noqa: BLE001 (a failing store is a miss, reported)
                    tier.failed(e, "a lookup")
                    continue
                tier.succeeded()
                seconds = time.perf_counter() - t0
                if value is None:
                    tier.add(queries=1, load_seconds=seconds)
                    missed.append(tier)
                    continue
                kv = open_value(value, key, want_tokens, want_extras, self.kv_nbytes)
                if kv is None:
                    tier.add(queries=1, rejected=1, load_seconds=seconds)
                    missed.append(tier)
                    continue
                tier.add(queries=1, hits=1, bytes_loaded=len(value), load_seconds=time.perf_counter() - t0)
                if not tier.fast:
                    tier.remember(key)
                for faster in missed:  # promote into the in-memory tier that missed it
                    if faster.fast:
                        faster.store.put(key, value)
                break
            if kv is None:
                break
            found.append(kv)
        return found

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
        value = seal(save.head, kv)
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
            elif not tier.writer.submit(save.key, value):
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
        for tier in self.tiers:
            if tier.writer is not None:
                tier.writer.flush()
                tier.writer.close()
            try:
                tier.store.close()
            except Exception:  # noqa: BLE001 (closing a broken connection)
                pass

    def stats(self) -> tuple[TierStats, ...]:
        return tuple(tier.snapshot() for tier in self.tiers)


def _extras_bytes(extras: Sequence[Any] | None, index: int) -> bytes | None:
    """The extra keys of blocks 0..index, exactly (None when the request has none)."""
    if not extras:
        return None
    return cbor2.dumps(list(extras[: index + 1]), canonical=True)
