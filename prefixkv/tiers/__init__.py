"""prefixkv.tiers: KV blocks below the pool - CPU memory, a disk folder, a Redis database -
keyed by the chained content hash, namespaced by the engine's cache identity (docs/tiers.md).

The engine sees a KV connector of two halves (connector.py): scheduler_connector.py plans loads
and saves, transfer.py executes them on the per-block tensors; null.py is the connector of an
engine without tiers; build.py builds both halves; plans.py holds the typed plans between them.
Below: manager.py (the tiers as one list: lookup, save, backoff), tier.py (one tier), lookup.py
(the walk along a request's chain), loader.py (its threads), writer.py (background writes),
value.py (what a value holds and the checks on load), namespace.py (the cache identity of keys),
stats.py (counters), spec.py (--kv-tier entries), registry.py (backends by scheme), store.py
(the protocol: bytes by key), and the backends cpu.py, disk.py, redis.py.
"""

from typing import TYPE_CHECKING

from ..lazy_exports import lazy_exports

# each backend registers itself when imported: a new one is one file and one line here
from . import cpu, disk, redis  # noqa: F401
from .connector import PendingLoads, PendingSaves, SchedulerConnector, WorkerConnector
from .cpu import CPUStore
from .disk import DiskStore
from .manager import TierManager
from .null import NULL_SCHEDULER_CONNECTOR, NULL_WORKER_CONNECTOR
from .plans import KVLoad, KVSave, SavedBlock
from .registry import TierBackend, build_stores, parse_spec, register_backend
from .spec import TierSpec, split_specs
from .stats import TierStats
from .store import KVStore

if TYPE_CHECKING:
    from .build import NULL_CONNECTOR, KVConnector, build_kv_connector

__all__ = [
    "CPUStore",
    "DiskStore",
    "KVConnector",
    "KVLoad",
    "KVSave",
    "KVStore",
    "NULL_CONNECTOR",
    "NULL_SCHEDULER_CONNECTOR",
    "NULL_WORKER_CONNECTOR",
    "PendingLoads",
    "PendingSaves",
    "SavedBlock",
    "SchedulerConnector",
    "TierBackend",
    "TierManager",
    "TierSpec",
    "TierStats",
    "WorkerConnector",
    "build_kv_connector",
    "build_stores",
    "parse_spec",
    "register_backend",
    "split_specs",
]

# the connector's worker half moves tensors (torch): imported on first use, so that checking
# --kv-tier flags (EngineArgs, the replicas' router) imports no torch
__getattr__ = lazy_exports(
    __name__, {"NULL_CONNECTOR": ".build", "KVConnector": ".build", "build_kv_connector": ".build"}
)
