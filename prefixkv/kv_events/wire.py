"""vLLM's KV event wire format, encoded with plain msgpack.

vLLM defines the messages as msgspec Structs (vllm/distributed/kv_events.py): an `EventBatch` is
encoded as an array `[ts, events, data_parallel_rank]` (array_like), each event as a map tagged
by its class name under "type", fields in declaration order, fields equal to their default left
out (omit_defaults). vLLM encoded the events as tagged arrays too until PR #42892 (June 2026,
vLLM >= 0.24); this module writes what vLLM 0.32 writes:

    [1789095808.83, [{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": None,
      "token_ids": [...], "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None,
      "extra_keys": [None], "group_idx": 0, "kv_cache_spec_kind": "full_attention"}], 0]

Block hashes go out as vLLM's `ExternalBlockHash`: by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
unset or 1, as in vLLM) the last 8 bytes of the content hash as an unsigned big-endian integer;
with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 the whole digest as bytes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

try:
    import msgpack
except ImportError:  # the kv-events extra: refused by name when a publisher is asked for (publisher.py)
    msgpack = None

from ..cache import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

ExternalBlockHash = int | bytes


def msgpack_missing() -> bool:
    return msgpack is None


def int_block_hashes() -> bool:
    """vLLM's switch (an environment variable, read once per publisher): int hashes unless '0'/'false'."""
    return os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1").strip().lower() not in ("0", "false")


def to_int_hash(digest: bytes) -> int:
    """vLLM's maybe_convert_block_hash: the digest's last 8 bytes, big-endian, unsigned."""
    return int.from_bytes(digest[-8:], "big")


def _identity(digest: bytes) -> bytes:
    return digest


def hash_converter(use_int: bool | None = None) -> Callable[[bytes], ExternalBlockHash]:
    return to_int_hash if (int_block_hashes() if use_int is None else use_int) else _identity


def event_to_wire(event: KVCacheEvent, convert: Callable[[bytes], ExternalBlockHash]) -> dict[str, Any]:
    """One cache event as vLLM's tagged map (defaults omitted as msgspec's omit_defaults does)."""
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        extra = event.extra_keys if event.extra_keys is not None else [None] * len(event.block_hashes)
        wire = {
            "type": "BlockStored",
            "block_hashes": [convert(h) for h in event.block_hashes],
            "parent_block_hash": convert(parent) if parent is not None else None,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
            "extra_keys": [list(k) if k is not None else None for k in extra],
            # a hybrid model's groups (docs/design.md, "KV-cache groups"); one group: 0, full attention
            "group_idx": event.group_idx,
            "kv_cache_spec_kind": event.kv_cache_spec_kind,
        }
        if event.kv_cache_spec_sliding_window is not None:
            wire["kv_cache_spec_sliding_window"] = event.kv_cache_spec_sliding_window
        return wire
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": [convert(h) for h in event.block_hashes],
            "medium": event.medium,
            "group_idx": event.group_idx,
        }
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV cache event: {type(event).__name__}")


def encode_batch(
    events: Sequence[KVCacheEvent],
    convert: Callable[[bytes], ExternalBlockHash],
    ts: float | None = None,
    data_parallel_rank: int = 0,
) -> bytes:
    """An EventBatch payload: msgpack of [ts, [event, ...], data_parallel_rank]."""
    batch = [time.time() if ts is None else ts, [event_to_wire(e, convert) for e in events], data_parallel_rank]
    packed: bytes = msgpack.packb(batch, use_bin_type=True)
    return packed
