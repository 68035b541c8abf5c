"""Routing requests over engine replicas by where their prefix is cached.

index.py   PrefixIndex: replica -> chained block hashes it caches, from KV events (precise) or
           from what the router sent (approximate)
policy.py  round-robin, prefix, prefix-load routers and their knobs; ReplicaLoad
The replay simulator drives them over N simulated replicas (prefixkv/replay/cluster.py,
`prefixkv replay --replicas N --router R`).
"""

from .index import MODES, PrefixIndex
from .policy import ROUTERS, PrefixLoadRouter, PrefixRouter, ReplicaLoad, RoundRobinRouter, Router, make_router

__all__ = [
    "MODES",
    "ROUTERS",
    "PrefixIndex",
    "PrefixLoadRouter",
    "PrefixRouter",
    "ReplicaLoad",
    "RoundRobinRouter",
    "Router",
    "make_router",
]
