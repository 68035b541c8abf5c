"""prefixkv.cache: hash-addressed KV blocks with exact automatic prefix caching.

Knows nothing of models, engine or server; see protocol.py for what it needs of a request.
"""
from .block import KVCacheBlock
from .events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from .identity import HASH_ALGOS, BlockChain, block_extra_keys, get_hash_function, none_hash
from .manager import KVCacheManager
from .policies import POLICIES, EvictionPolicy, FreeKVCacheBlockQueue, LRUPolicy, get_policy
from .pool import BlockPool
from .protocol import CacheRequest
from .stats import PrefixCacheStats

__all__ = [
    "AllBlocksCleared", "BlockChain", "BlockPool", "BlockRemoved", "BlockStored", "CacheRequest",
    "EvictionPolicy", "FreeKVCacheBlockQueue", "HASH_ALGOS", "KVCacheBlock", "KVCacheEvent",
    "KVCacheManager", "LRUPolicy", "POLICIES", "PrefixCacheStats", "block_extra_keys",
    "get_hash_function", "get_policy", "none_hash",
]
