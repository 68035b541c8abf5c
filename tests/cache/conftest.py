"""Helpers that play the scheduler's part against the manager, as the engine does."""

from __future__ import annotations

import pytest

from prefixkv.cache import KVCacheManager
from prefixkv.request import Request


def prefill(mgr: KVCacheManager, req: Request) -> list[int] | None:
    """Look up, allocate the whole prompt, mark it computed. Returns the new block ids."""
    hits, num_hit = mgr.get_computed_blocks(req)
    new = mgr.allocate_slots(req, req.num_tokens - num_hit, hits)
    if new is None:
        return None
    req.num_computed_tokens = req.num_tokens
    return [b.block_id for b in new]


def decode(mgr: KVCacheManager, req: Request, token: int) -> list[int] | None:
    """Append a sampled token, then allocate its slot and compute it."""
    req.append_output_token_ids([token])
    new = mgr.allocate_slots(req, 1)
    if new is None:
        return None
    req.num_computed_tokens += 1
    return [b.block_id for b in new]


def cached_ids(mgr: KVCacheManager) -> set[int]:
    return {b.block_id for b in mgr.block_pool.blocks if b.block_key is not None}


@pytest.fixture
def mgr10() -> KVCacheManager:
    return KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
