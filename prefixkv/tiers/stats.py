"""One tier's counters. The tier updates its own instance under its lock (engine thread, loader
and writer threads); metrics get copies (`Tier.snapshot`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
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

    def add(
        self,
        *,
        queries: int = 0,
        hits: int = 0,
        rejected: int = 0,
        bytes_loaded: int = 0,
        load_seconds: float = 0.0,
        saves: int = 0,
        bytes_saved: int = 0,
        save_seconds: float = 0.0,
        saves_dropped: int = 0,
    ) -> None:
        self.queries += queries
        self.hits += hits
        self.rejected += rejected
        self.bytes_loaded += bytes_loaded
        self.load_seconds += load_seconds
        self.saves += saves
        self.bytes_saved += bytes_saved
        self.save_seconds += save_seconds
        self.saves_dropped += saves_dropped
