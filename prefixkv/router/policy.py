"""Routing policies: which replica gets a request, from its chained block hashes and the replicas'
load. Pure Python (no engine, no network), so the replay simulator and a Ray Serve deployment
share them.

  round-robin  replicas in turn, blind to content and load.
  prefix       the replica holding the longest prefix of the request's block hashes (PrefixIndex);
               ties - including "nobody holds block 0" - go to the least loaded, then in turn. A block
               only a tier holds counts at the index's tier_discount (router/index.py).
  prefix-load  prefix, gated by load (the knobs of PrefixLoadRouter): a replica is out of the running
               when it is saturated (queue >= max_queue, or KV usage >= max_kv_usage) or much busier
               than the least busy one (queue > balance_rel x least + balance_abs); among the rest the
               least loaded. If every replica is saturated, only the balance gate applies (an
               overloaded cluster keeps its affinity among the least busy replicas). So a hot
               prefix stays on its replica until that replica fills up or runs ahead of the
               others, then spreads; the index learns the new copies from the replicas' events.
               The affinity that must reach min_match_blocks is the best match over the least
               among the candidates: blocks all of them can load from a shared tier add none.

Load: `queue` = requests sent to the replica whose prefill has not finished (waiting or
prefilling: what a new request waits behind), `running` = requests holding KV blocks there,
`kv_usage` = fraction of its KV blocks held. Those are vLLM's num_requests_waiting /
num_requests_running / kv_cache_usage_perc gauges, which a live router reads from /metrics.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from .index import BlockHash, PrefixIndex

ROUTERS = ("round-robin", "prefix", "prefix-load")


@dataclass(frozen=True)
class ReplicaLoad:
    queue: int = 0
    running: int = 0
    kv_usage: float = 0.0


def key_affinity(cache_key: str, replica: object) -> bytes:
    """Rendezvous (highest random weight) hashing: the replica with the largest weight for a key
    keeps it while replicas come and go (only the keys of a replica that leaves move)."""
    return hashlib.blake2b(f"{cache_key}\x00{replica}".encode(), digest_size=8).digest()


class Router:
    """choose(hashes, loads) -> index into `loads` (one entry per live replica, in the order of
    `replicas`; the index's replica ids are the same entries of `replicas`). `cache_key` (the
    request's prompt_cache_key, OpenAI's hint that requests share a prefix): among the replicas
    the policy would take alike, the key's own replica, so a key's requests meet on one replica
    before any of its blocks are known (the index's match, where it has one, still comes first)."""

    name = "base"

    def __init__(self) -> None:
        self._turn = 0

    def choose(
        self,
        hashes: Sequence[BlockHash],
        replicas: Sequence[object],
        loads: Sequence[ReplicaLoad],
        cache_key: str | None = None,
    ) -> int:
        raise NotImplementedError

    def _least_loaded(
        self,
        candidates: Sequence[int],
        loads: Sequence[ReplicaLoad],
        replicas: Sequence[object] = (),
        cache_key: str | None = None,
    ) -> int:
        """The key's replica among `candidates` when a key is given; else fewest queued, then
        fewest running, and among equals in turn (no replica is favoured)."""
        if cache_key is not None and replicas:
            return max(candidates, key=lambda i: key_affinity(cache_key, replicas[i]))
        best = min((loads[i].queue, loads[i].running) for i in candidates)
        tied = [i for i in candidates if (loads[i].queue, loads[i].running) == best]
        self._turn += 1
        return tied[self._turn % len(tied)]


class RoundRobinRouter(Router):
    name = "round-robin"

    def choose(
        self,
        hashes: Sequence[BlockHash],
        replicas: Sequence[object],
        loads: Sequence[ReplicaLoad],
        cache_key: str | None = None,
    ) -> int:
        if cache_key is not None:
            return self._least_loaded(range(len(loads)), loads, replicas, cache_key)
        self._turn += 1
        return self._turn % len(loads)


class PrefixRouter(Router):
    name = "prefix"

    def __init__(self, index: PrefixIndex) -> None:
        super().__init__()
        self.index = index

    def _best_match(
        self, hashes: Sequence[BlockHash], replicas: Sequence[object], candidates: Sequence[int]
    ) -> tuple[float, list[int]]:
        """The best match among `candidates` over the least of them (what the best saves that any
        candidate would not: a block every replica can load from a shared tier is no reason to
        prefer one), and the candidates that have it."""
        matched = self.index.match(hashes) if hashes else {}
        scores = [matched.get(replicas[i], 0) for i in candidates]
        best = max(scores, default=0)
        return best - min(scores, default=0), [i for i, m in zip(candidates, scores) if m == best]

    def choose(
        self,
        hashes: Sequence[BlockHash],
        replicas: Sequence[object],
        loads: Sequence[ReplicaLoad],
        cache_key: str | None = None,
    ) -> int:
        _, tied = self._best_match(hashes, replicas, range(len(loads)))
        return self._least_loaded(tied, loads, replicas, cache_key)


class PrefixLoadRouter(PrefixRouter):
    name = "prefix-load"

    def __init__(
        self,
        index: PrefixIndex,
        *,
        max_queue: int = 4,
        max_kv_usage: float = 0.95,
        balance_abs: int = 4,
        balance_rel: float = 2.0,
        min_match_blocks: int = 1,
    ) -> None:
        super().__init__(index)
        if max_queue < 1 or not 0 < max_kv_usage <= 1 or balance_abs < 0 or balance_rel < 1 or min_match_blocks < 1:
            raise ValueError(
                "prefix-load knobs: max_queue >= 1, 0 < max_kv_usage <= 1, balance_abs >= 0, balance_rel >= 1, "
                "min_match_blocks >= 1"
            )
        self.max_queue = max_queue
        self.max_kv_usage = max_kv_usage
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.min_match_blocks = min_match_blocks

    def choose(
        self,
        hashes: Sequence[BlockHash],
        replicas: Sequence[object],
        loads: Sequence[ReplicaLoad],
        cache_key: str | None = None,
    ) -> int:
        ok = [i for i, ld in enumerate(loads) if ld.queue < self.max_queue and ld.kv_usage < self.max_kv_usage]
        if not ok:  # everyone is saturated: the balance gate alone decides who may take it
            ok = list(range(len(loads)))
        least = min(loads[i].queue for i in ok)
        limit = self.balance_rel * least + self.balance_abs
        ok = [i for i in ok if loads[i].queue <= limit]
        best, tied = self._best_match(hashes, replicas, ok)
        return self._least_loaded(tied if best >= self.min_match_blocks else ok, loads, replicas, cache_key)


def make_router(name: str, index: PrefixIndex | None = None, **knobs: float) -> Router:
    """A router by name; prefix routers need the index, prefix-load takes its knobs by name."""
    if name == "round-robin":
        if knobs:
            raise ValueError(f"round-robin takes no knobs, got {', '.join(knobs)}")
        return RoundRobinRouter()
    if name in ("prefix", "prefix-load"):
        if index is None:
            raise ValueError(f"the {name} router needs a PrefixIndex")
        if name == "prefix":
            if knobs:
                raise ValueError(f"prefix takes no knobs, got {', '.join(knobs)}")
            return PrefixRouter(index)
        return PrefixLoadRouter(index, **knobs)  # type: ignore[arg-type]
    raise ValueError(f"unknown router {name!r}; choose one of {', '.join(ROUTERS)}")
