"""KV-cache events for external indexes and routers, in the order they happened."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

# The tier an event is about, vLLM's `medium` names: the KV pool is "GPU" in vLLM whatever the
# device (vLLM-CPU says "GPU" too), lower tiers say "CPU", "DISK", ...
MEDIUM_POOL = "GPU"
# vLLM's kv_cache_spec_kind names
FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[bytes]  # content hashes of consecutive newly cached blocks
    parent_block_hash: bytes | None  # None when the first of them is block 0
    token_ids: list[int]
    block_size: int
    lora_name: str | None
    # the extra keys each block was hashed with (None for a block without any), so that a consumer
    # can recompute the hashes; LoRA integer id (vLLM's deprecated lora_id); the tier
    extra_keys: list[tuple[object, ...] | None] | None = None
    lora_id: int | None = None
    medium: str = MEDIUM_POOL
    # vLLM's hybrid-model fields: the KV-cache group the blocks belong to (0: the full-attention
    # layers, whose blocks name the prefix), its kind and, for a sliding-window group, the window
    group_idx: int = 0
    kv_cache_spec_kind: str = FULL_ATTENTION
    kv_cache_spec_sliding_window: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str = MEDIUM_POOL
    group_idx: int = 0


@dataclass(frozen=True)
class AllBlocksCleared:
    medium: str | None = None  # None: every tier this process publishes (vLLM's event has no medium)


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBuffer:
    """Events not yet taken, bounded: when `max_pending` are waiting, the oldest is dropped for
    the newest and counted in `num_dropped` (a consumer that falls behind loses the oldest
    events, never the process's memory)."""

    __slots__ = ("_events", "max_pending", "num_dropped")

    def __init__(self, max_pending: int) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending_kv_events must be at least 1, got {max_pending}")
        self._events: deque[KVCacheEvent] = deque(maxlen=max_pending)
        self.max_pending = max_pending
        self.num_dropped = 0

    def __len__(self) -> int:
        return len(self._events)

    def append(self, event: KVCacheEvent) -> None:
        events = self._events
        if len(events) == self.max_pending:
            self.num_dropped += 1  # the deque drops the oldest
        events.append(event)

    def extend(self, new: Iterable[KVCacheEvent]) -> None:
        for event in new:
            self.append(event)

    def drain(self) -> list[KVCacheEvent]:
        """Every pending event, oldest first; the buffer is empty afterwards."""
        events = list(self._events)
        self._events.clear()
        return events
