"""What a `--kv-tier` entry says once parsed (`TierSpec`), and the parsing every backend shares:
the flag may repeat and each may be a comma list; `load=async|sync` picks the thread that reads a
slow tier. Which backend an entry names is the registry's business (registry.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TierSpec:
    kind: str  # the backend's name: "disk", "redis", ...
    target: str  # what the backend reads: the folder, the Redis URL, ...
    size_bytes: int | None = None  # the bound, for a backend that keeps one itself
    sync_load: bool = False  # `load=sync` (a backend may parse it later, from `target`)


def split_specs(value: str | Sequence[str] | None) -> list[str]:
    """Flags may repeat and each may be a comma list."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else list(value)
    out: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"kv_tier entries must be strings, got {type(item).__name__}")
        out.extend(p.strip() for p in item.split(",") if p.strip())
    return out


def parse_load_mode(text: str, spec: str) -> bool:
    """`load=async` (default for slow tiers) or `load=sync`; True for sync."""
    if text not in ("async", "sync"):
        raise ValueError(f"load must be async or sync in the KV tier {spec!r}, got {text!r}")
    return text == "sync"
