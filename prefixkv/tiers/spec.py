"""`--kv-tier` specs: `disk:PATH[?size=SIZE][&load=sync]` and
`redis://HOST:PORT/DB[?timeout=SECONDS][&load=sync]`, repeatable or comma-separated, looked up in
the order given (after the CPU tier). `load=async` (the default) loads hits in a background
thread while the engine goes on; `load=sync` on the engine thread at admission."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import parse_qs

from .disk import DEFAULT_DISK_BYTES


@dataclass(frozen=True)
class TierSpec:
    kind: str  # "disk" or "redis"
    target: str  # the folder, or the Redis URL
    size_bytes: int | None = None  # disk: the bound
    sync_load: bool = False  # disk: `load=sync` (Redis parses its own URL)


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


def parse_spec(text: str) -> TierSpec:
    from ..engine_args import parse_bytes

    if text.startswith(("redis://", "rediss://", "unix://")):
        return TierSpec("redis", text)
    if text.startswith("disk:"):
        path, _, query = text[len("disk:") :].partition("?")
        if not path:
            raise ValueError(f"the disk tier {text!r} names no folder (disk:/path/to/folder)")
        opts = parse_qs(query, keep_blank_values=True)
        size = DEFAULT_DISK_BYTES
        if "size" in opts:
            try:
                size = parse_bytes(opts.pop("size")[0])
            except Exception as e:  # noqa: BLE001 (argparse's error type: said as a ValueError)
                raise ValueError(f"bad size in the disk tier {text!r}: {e}") from None
        sync_load = parse_load_mode(opts.pop("load", ["async"])[0], text)
        if opts:
            raise ValueError(f"unknown option(s) {', '.join(opts)} in the disk tier {text!r} (known: size, load)")
        return TierSpec("disk", path, size, sync_load)
    raise ValueError(
        f"unknown KV tier {text!r}: use disk:/path/to/folder[?size=16GiB][&load=sync] or redis://host:port/db[?timeout=0.5][&load=sync]"
        " (the CPU tier is --kv-offloading-size)"
    )
