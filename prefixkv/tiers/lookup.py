"""A request's lookup in the tiers: the walk along its hash chain (tiers asked in order, a slow
tier in batches of blocks, every value checked), what a value must carry to be loaded, and the
handle of an asynchronous lookup (`TierFetch`)."""

from __future__ import annotations

import time
from array import array
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import cbor2

from .tier import Tier
from .value import authenticated, open_value, value_nbytes, without_mac

REMOTE_BATCH = 16  # blocks asked of a slow tier in one round trip


def extras_bytes(extras: Sequence[Any] | None, index: int) -> bytes | None:
    """The extra keys of blocks 0..index, exactly (None when the request has none)."""
    if not extras:
        return None
    return cbor2.dumps(list(extras[: index + 1]), canonical=True)


@dataclass(frozen=True, slots=True)
class Want:
    """What a request's values must carry to be loaded (value.py): its prefix tokens and extra keys."""

    tokens: memoryview  # int32 token ids, enough for the last block looked up
    extras: Sequence[Any] | None
    block_size: int


def want_of(token_ids: Sequence[int], extras: Sequence[Any] | None, block_size: int, last: int) -> Want:
    tokens = memoryview(array("i", token_ids[: last * block_size]).tobytes())
    return Want(tokens, list(extras[:last]) if extras else None, block_size)


Found = tuple[memoryview, bytes, Tier, bytes]  # checked KV bytes, the whole value, its tier, its key


class TierFetch:
    """One request's lookup in the asynchronous tiers (blocks `first`..), on a loader thread.
    While it runs the request waits (vLLM's WAITING_FOR_REMOTE_KVS) and holds no block."""

    __slots__ = ("first", "deadline", "future", "tier", "abandoned")

    def __init__(self, first: int, deadline: float) -> None:
        self.first = first
        self.deadline = deadline  # time.monotonic(): past it the load is given up
        self.future: Future[list[Found]] | None = None
        self.tier: Tier | None = None  # the tier being asked now (blamed on a timeout)
        self.abandoned = False

    def ready(self) -> bool:
        """Done, or past its deadline (then `take_fetched` gives up on it)."""
        return self.future is None or self.future.done() or time.monotonic() >= self.deadline

    def cancel(self) -> None:
        """The request left (aborted, finished) or no longer needs it: stop at the next block."""
        self.abandoned = True
        if self.future is not None:
            self.future.cancel()


def walk(
    tiers: Sequence[Tier],
    keys: Sequence[bytes],
    want: Want,
    first: int,
    kv_nbytes: int,
    fetch: TierFetch | None = None,
    secret: bytes | None = None,
) -> list[Found]:
    """Blocks first, first + 1, ... (keys[i - first]) found in `tiers`, asked in order, checked
    (with a tier `secret`, a slow tier's values authenticated first); stops at the first block no
    tier holds. Runs on the engine thread (in-memory and `load=sync` tiers) or a loader thread
    (`fetch`: the others, which never touch the in-memory ones)."""
    found: list[Found] = []
    batches: dict[int, dict[int, bytes | None]] = {}  # slow tier -> block index -> value
    last = first + len(keys)
    bs = want.block_size
    extras_of: dict[int, bytes | None] = {}  # block index -> its extras bytes (asked per batch and per block)

    def extras(i: int) -> bytes | None:
        if i not in extras_of:
            extras_of[i] = extras_bytes(want.extras, i)
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
        hit: Found | None = None
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
