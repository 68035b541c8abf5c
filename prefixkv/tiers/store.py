"""The store protocol every tier implements: opaque values (bytes) by key (bytes).

A store knows nothing of KV blocks: what a value holds and whether it is the right one is
value.py's business (every value carries its full key and a checksum, checked on load). A store
signals trouble by raising (any exception): the tier manager then serves without it for a while.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class KVStore(Protocol):
    """Bytes by key. `get_many` is how lookups read (one round trip for a remote store); `put`
    may be slow (the manager calls it from a background writer for stores that are not `fast`)."""

    name: str  # what metrics and logs call it: "cpu", "disk", "redis"
    fast: bool  # in-process memory: written inline, never down

    def get(self, key: bytes) -> bytes | None: ...

    def get_many(self, keys: Sequence[bytes], sizes: Sequence[int] | None = None) -> list[bytes | None]:
        """`sizes`: the exact size each usable value has (value.value_nbytes); a store may refuse a
        value of another size without reading it (the disk tier does) by returning b"" for it,
        which the checks count as rejected."""
        ...

    def put(self, key: bytes, value: bytes) -> None: ...

    def contains(self, key: bytes) -> bool: ...

    def close(self) -> None: ...


def describe(store: KVStore) -> str:
    """A store's label for logs (its URL-ish spec when it has one)."""
    return getattr(store, "spec", store.name)


class UnusableStore:
    """A tier that could not be set up (its folder cannot be created): every call fails, so the
    manager counts the error, warns once, and backs off (the engine serves by recomputing)."""

    fast = False

    def __init__(self, name: str, spec: str, error: OSError) -> None:
        self.name, self.spec, self.error = name, spec, error

    def get(self, key: bytes) -> bytes | None:
        raise self.error

    def get_many(self, keys: Sequence[bytes], sizes: Sequence[int] | None = None) -> list[bytes | None]:
        raise self.error

    def put(self, key: bytes, value: bytes) -> None:
        raise self.error

    def contains(self, key: bytes) -> bool:
        raise self.error

    def close(self) -> None:
        pass
