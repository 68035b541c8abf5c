"""prefixkv.cache: KV blocks with exact automatic prefix caching (docs/design.md).

Knows nothing of models, engine or server; see protocol.py for what it needs of a request.
Layout: identity.py (exact block keys, extra keys, content hashes), block.py, table.py (exact
identity -> cached block(s)), eviction/ (the free set and eviction order; `POLICIES` names every
policy), pool.py (blocks, table, policy, events), manager.py (lookup, allocation, free), pins.py (pinned
prefixes), residency.py (sampled block residency metrics).
"""

from .block import KVCacheBlock
from .events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, KVEventBuffer
from .eviction import (
    POLICIES,
    EvictionPolicy,
    FreeKVCacheBlockQueue,
    HeapPolicy,
    LRUPolicy,
    get_policy,
    register_policy,
)
from .identity import HASH_ALGOS, BlockChain, BlockKey, block_extra_keys, get_hash_function, none_hash
from .manager import KVCacheManager
from .pins import Pin, PinError, PinnedPrefixes
from .pool import BlockPool
from .protocol import CacheRequest
from .residency import EVICTION_CAUSES, ResidencyMetrics, ResidencyObservations
from .stats import PrefixCacheStats
from .table import CachedBlockTable

__all__ = [
    "AllBlocksCleared",
    "BlockChain",
    "BlockKey",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CacheRequest",
    "CachedBlockTable",
    "EvictionPolicy",
    "FreeKVCacheBlockQueue",
    "HASH_ALGOS",
    "HeapPolicy",
    "KVCacheBlock",
    "KVCacheEvent",
    "KVCacheManager",
    "KVEventBuffer",
    "LRUPolicy",
    "POLICIES",
    "Pin",
    "PinError",
    "PinnedPrefixes",
    "PrefixCacheStats",
    "EVICTION_CAUSES",
    "ResidencyMetrics",
    "ResidencyObservations",
    "block_extra_keys",
    "get_hash_function",
    "get_policy",
    "none_hash",
    "register_policy",
]
