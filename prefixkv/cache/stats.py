from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefixCacheStats:
    """Counted at admission: every looked-up request's tokens are queries, its cached ones hits.
    A preempted request admitted again finds its own blocks: those lookups are counted apart
    (`preempted_*`, as vLLM's PrefixCacheStats keeps them), never as prefix-cache hits."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def record(self, num_tokens: int, num_hits: int, preempted: bool = False) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits
