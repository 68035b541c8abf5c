"""Encoder outputs kept by item identity, within a byte budget, least recently used first out.

A request's image is encoded when its first placeholder is computed; later chunks of the same
prefill, requests that hit only part of the image's KV blocks (the rest of the image still needs
its embedding rows), and other requests with the same image read the rows they need from here
instead of running the encoder again. Only the model runner touches it (one thread).

Entries are keyed by (item identity, the request's cache_salt), not by the identity alone: a
salted request reads only outputs computed for its own salt, unsalted requests only unsalted
ones. Under `mm_hash="phash"` two images with the same perceptual hash are one item, so without
the salt in the key one tenant's image would be answered with another tenant's encoder output;
under "exact" the output would be the same, but a hit would still tell a tenant that another sent
the image (timing). The prefix cache keeps salts apart through the block chain (the salt is an
extra key of block 0, prefixkv/cache/identity.py)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

import torch

# (item identity, cache salt): EncoderInput.cache_key. Any hashable key is accepted (tests use strings).
EncoderKey = Hashable


@dataclass(frozen=True, slots=True)
class EncoderCacheStats:
    queries: int = 0  # items looked up (once per item per step that needs it)
    hits: int = 0  # ... found
    encoder_runs: int = 0  # images encoded
    evictions: int = 0
    entries: int = 0
    bytes_used: int = 0
    budget_bytes: int = 0


class EncoderCache:
    """`budget_bytes` 0 keeps nothing (every lookup misses): the encoder cache off."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"the encoder cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[EncoderKey, torch.Tensor] = OrderedDict()
        self.bytes_used = 0
        self.queries = 0
        self.hits = 0
        self.encoder_runs = 0
        self.evictions = 0

    def get(self, identifier: EncoderKey) -> torch.Tensor | None:
        self.queries += 1
        out = self._entries.get(identifier)
        if out is not None:
            self.hits += 1
            self._entries.move_to_end(identifier)
        return out

    def put(self, identifier: EncoderKey, output: torch.Tensor) -> None:
        """Keep `output` (evicting the least recently used); one larger than the budget is not kept."""
        size = output.numel() * output.element_size()
        if size > self.budget_bytes or identifier in self._entries:
            return
        while self.bytes_used + size > self.budget_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes_used -= old.numel() * old.element_size()
            self.evictions += 1
        self._entries[identifier] = output
        self.bytes_used += size

    def __contains__(self, identifier: object) -> bool:
        return identifier in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.bytes_used = 0

    def stats(self) -> EncoderCacheStats:
        return EncoderCacheStats(
            self.queries,
            self.hits,
            self.encoder_runs,
            self.evictions,
            len(self._entries),
            self.bytes_used,
            self.budget_bytes,
        )
