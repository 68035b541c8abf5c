"""Tier backends by name and URL scheme: a backend is a store (store.py's protocol) plus one
`register_backend` call that says which `--kv-tier` entries are its, how to check one, how to
build its store, and the `medium` its KV events carry. The built-in ones register themselves in
cpu.py, disk.py and redis.py (imported by the package)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .spec import TierSpec, split_specs
from .store import KVStore

logger = logging.getLogger("prefixkv")


@dataclass(frozen=True)
class TierBackend:
    name: str  # the store's `name`: what metrics and logs call the tier
    medium: str  # KV events' `medium` for blocks it stores and drops ("CPU", "DISK", ...)
    # what its `--kv-tier` entries start with ("disk:", "redis://"); none: built from another flag
    prefixes: tuple[str, ...]
    parse: Callable[[str], TierSpec]  # checks an entry when the arguments are (no I/O)
    build: Callable[[TierSpec], KVStore]  # the store; one that cannot be reached now is still built
    usage: str = ""  # the entry's syntax, for the message that refuses an unknown one


BACKENDS: dict[str, TierBackend] = {}


def register_backend(backend: TierBackend) -> TierBackend:
    if backend.name in BACKENDS:
        raise ValueError(f"a KV tier backend named {backend.name!r} is registered already")
    BACKENDS[backend.name] = backend
    return backend


def medium_of(name: str) -> str:
    backend = BACKENDS.get(name)
    return backend.medium if backend is not None else name.upper()


def backend_for(text: str) -> TierBackend | None:
    return next((b for b in BACKENDS.values() if b.prefixes and text.startswith(b.prefixes)), None)


def parse_spec(text: str) -> TierSpec:
    backend = backend_for(text)
    if backend is None:
        usages = " or ".join(b.usage for b in BACKENDS.values() if b.prefixes and b.usage)
        raise ValueError(f"unknown KV tier {text!r}: use {usages} (the CPU tier is --kv-offloading-size)")
    return backend.parse(text)


def build_stores(kv_offloading_size: float | None, kv_tier: str | Sequence[str] | None) -> list[KVStore]:
    """CPU first (fastest), then the --kv-tier entries in the order given. A tier that cannot be
    reached now is still built: it is tried again later (the engine serves)."""
    stores: list[KVStore] = []
    if kv_offloading_size:
        stores.append(BACKENDS["cpu"].build(TierSpec("cpu", "", int(kv_offloading_size * (1 << 30)))))
    for text in split_specs(kv_tier):
        spec = parse_spec(text)
        stores.append(BACKENDS[spec.kind].build(spec))
    return stores
