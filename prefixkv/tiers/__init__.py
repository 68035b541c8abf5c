"""prefixkv.tiers: KV blocks below the pool - CPU memory, a disk folder, a Redis database -
keyed by the chained content hash, namespaced by the engine's cache identity (docs/tiers.md).

Layout: store.py (the protocol: bytes by key), cpu.py, disk.py, redis.py (the stores), value.py
(what a value holds and the checks on load), namespace.py (the cache identity of keys),
writer.py (background writes for slow stores), manager.py (scheduler side: what to save and
load), transfer.py (runner side: block <-> bytes), spec.py (--kv-tier), setup.py (wiring).
"""

from .cpu import CPUStore
from .disk import DiskStore
from .manager import KVLoad, KVSave, TierManager, TierStats
from .setup import attach_tiers, build_stores
from .spec import TierSpec, parse_spec, split_specs
from .store import KVStore

__all__ = [
    "CPUStore",
    "DiskStore",
    "KVLoad",
    "KVSave",
    "KVStore",
    "TierManager",
    "TierSpec",
    "TierStats",
    "attach_tiers",
    "build_stores",
    "parse_spec",
    "split_specs",
]
