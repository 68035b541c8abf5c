"""KV-cache events for external indexes and routers, in the order they happened."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[bytes]  # content hashes of consecutive newly cached blocks
    parent_block_hash: bytes | None  # None when the first of them is block 0
    token_ids: list[int]
    block_size: int
    lora_name: str | None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[bytes]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
