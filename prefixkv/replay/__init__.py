"""prefixkv.replay: replay a request trace through the real KVCacheManager to compare eviction
policies and cache sizes, with Belady's offline optimum as the yardstick (see docs/replay.md)."""

from .optimum import replay_optimum
from .simulator import ReplayResult, TimeModel, replay
from .trace import TraceRequest, expand_hash_ids, load_jsonl, load_mooncake, load_trace

__all__ = [
    "ReplayResult",
    "TimeModel",
    "TraceRequest",
    "expand_hash_ids",
    "load_jsonl",
    "load_mooncake",
    "load_trace",
    "replay",
    "replay_optimum",
]
