from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefixCacheStats:
    """Counted at admission: every looked-up request's tokens are queries, its cached ones hits."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def record(self, num_tokens: int, num_hits: int) -> None:
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hits
