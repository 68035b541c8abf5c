"""Eviction policies: which free block (ref count 0) is reused next (docs/design.md, "Block pool
and eviction"; docs/replay.md compares them on real traces).

One file per family: `base` (the interface and its hooks), `lru` (vLLM's order, the default
and the hot path), `heap` (the lazy-deletion heap the ranked policies share), `frequency`
(unhashed-first, LFU), `credit` (reuse-, ghost- and adaptive-credit, with the ghost and
reuse-distance helpers), `predicted` (predicted-reuse), `priority` (request priority).
`POLICIES` maps each name to its class; `register_policy` adds one, `get_policy` resolves a name
(or passes a class through).
"""

from __future__ import annotations

from typing import TypeVar

from .base import EvictionPolicy, overrides
from .credit import AdaptiveCreditPolicy, Ghost, GhostCreditPolicy, GhostCredits, ReuseCreditPolicy, ReuseDistances
from .frequency import LFUPolicy, UnhashedFirstPolicy
from .heap import HeapPolicy
from .lru import FreeKVCacheBlockQueue, LRUPolicy
from .predicted import PredictedReusePolicy, ReuseRates
from .priority import PriorityPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls
    for cls in (
        LRUPolicy,
        UnhashedFirstPolicy,
        LFUPolicy,
        ReuseCreditPolicy,
        GhostCreditPolicy,
        AdaptiveCreditPolicy,
        PredictedReusePolicy,
        PriorityPolicy,
    )
}

P = TypeVar("P", bound=type[EvictionPolicy])


def register_policy(cls: P) -> P:
    """Class decorator: make a policy available by its `name` (e.g. to KVCacheManager)."""
    POLICIES[cls.name] = cls
    return cls


def get_policy(name: str | type[EvictionPolicy]) -> type[EvictionPolicy]:
    """The policy class registered as `name`; a policy class is returned as is."""
    if isinstance(name, type) and issubclass(name, EvictionPolicy):
        return name
    try:
        return POLICIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(POLICIES)}") from None


__all__ = [
    "POLICIES",
    "AdaptiveCreditPolicy",
    "EvictionPolicy",
    "FreeKVCacheBlockQueue",
    "Ghost",
    "GhostCreditPolicy",
    "GhostCredits",
    "HeapPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "PredictedReusePolicy",
    "PriorityPolicy",
    "ReuseCreditPolicy",
    "ReuseDistances",
    "ReuseRates",
    "UnhashedFirstPolicy",
    "get_policy",
    "overrides",
    "register_policy",
]
