"""Continuous batching with a token budget, chunked prefill, prefix-cache lookup and
preemption by recompute, first come first served."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ..cache import KVCacheManager
from ..request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    """One step's work: requests in batch order with the number of new tokens each computes.
    Block tables are read from the cache manager when the batch is built."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.requests)


class Scheduler:
    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        now = time.time()

        # Running requests first, oldest first; when blocks run out, the newest is preempted.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while self.kv.allocate_slots(req, num_new) is None:
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    break
            else:
                batch.requests.append(req)
                batch.num_new_tokens.append(num_new)
                budget -= num_new
                i += 1

        # Then waiting ones, in arrival order, unless this step had to preempt.
        while (self.waiting and budget > 0 and not batch.preempted
               and len(self.running) < self.max_num_seqs):
            req = self.waiting[0]
            if req.skip_prefix_cache_read:
                hits, num_hit = [], 0
            else:
                hits, num_hit = self.kv.get_computed_blocks(req, record_stats=False)
            num_new = min(req.num_tokens - num_hit, budget)
            if self.kv.allocate_slots(req, num_new, hits) is None:
                break  # FCFS: nothing behind it jumps the queue
            self.waiting.popleft()
            if self.kv.enable_caching and not req.skip_prefix_cache_read:
                self.kv.stats.record(req.num_tokens, num_hit)
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                req.first_scheduled_time = now
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.requests.append(req)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        return batch

    def _preempt(self, req: Request) -> None:
        """Recompute later: free the blocks (they keep their identity, so the request re-hits
        whatever survives) and put the request back at the front of the queue."""
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Remove a request (finished or aborted) wherever it is and release its blocks."""
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
