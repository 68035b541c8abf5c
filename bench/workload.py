"""Synthetic request traces and the driver loop shared by every cache-manager benchmark.

Pure Python on purpose: the same file is imported by prefixkv's benchmark and by the peer
scripts that run inside another engine's virtual environment (bench/peers/), so both
managers see exactly the same requests in exactly the same order.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class TraceRequest:
    request_id: str
    prompt: list[int]
    output: list[int]  # tokens "sampled" by decode steps, fixed in advance so runs compare


@dataclass(frozen=True)
class Trace:
    name: str
    block_size: int
    num_blocks: int
    max_running: int  # requests in flight at once: 1 = sequential, >1 = memory pressure
    requests: list[TraceRequest]


def reference_trace(num_requests: int = 2000, seed: int = 0) -> Trace:
    """The issue's reference trace: 8 documents of 1,500 tokens, each request one document plus
    20 random tokens, 16 decode steps, then freed; block size 16, 8,192 blocks, one at a time."""
    rng = random.Random(seed)
    docs = [[rng.randrange(1, 32000) for _ in range(1500)] for _ in range(8)]
    reqs = []
    for i in range(num_requests):
        prompt = docs[rng.randrange(8)] + [rng.randrange(1, 32000) for _ in range(20)]
        output = [rng.randrange(1, 32000) for _ in range(17)]  # 1 from prefill + 16 decode steps
        reqs.append(TraceRequest(f"req-{i}", prompt, output))
    return Trace("reference", 16, 8192, 1, reqs)


def pressure_trace(num_requests: int = 3000, seed: int = 1) -> Trace:
    """Memory pressure: 32 system prompts of 1-2k tokens (10% of requests share none), random
    suffixes of 10-200 tokens, 8-64 decode steps, 48 requests in flight over 2,048 blocks of 16,
    so cached blocks are evicted all the time and some allocations fail."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 32000) for _ in range(rng.randrange(1000, 2000))] for _ in range(32)]
    weights = [1.0 / (k + 1) for k in range(32)]  # Zipf-like popularity
    reqs = []
    for i in range(num_requests):
        prefix = [] if rng.random() < 0.1 else rng.choices(prompts, weights)[0]
        suffix = [rng.randrange(1, 32000) for _ in range(rng.randrange(10, 200))]
        output = [rng.randrange(1, 32000) for _ in range(rng.randrange(8, 64))]
        reqs.append(TraceRequest(f"req-{i}", prefix + suffix, output))
    return Trace("pressure", 16, 2048, 48, reqs)


TRACES = {"reference": reference_trace, "pressure": pressure_trace}


class ManagerAdapter(Protocol):
    """What the driver needs of a KV-cache manager under test."""

    def start(self, req: TraceRequest) -> object:
        """Create the engine's request object for a trace request."""

    def lookup(self, handle: object) -> tuple[object, int]:
        """Prefix-cache lookup: (computed blocks, number of hit tokens)."""

    def allocate(self, handle: object, num_new_tokens: int, computed: object, num_hit: int) -> bool:
        """Allocate slots; False if the pool cannot hold them (nothing changed)."""

    def advance(self, handle: object, num_tokens: int, token: int | None) -> None:
        """Mark num_tokens computed; if token is not None append it as a sampled output."""

    def free(self, handle: object) -> None:
        """Release the request's blocks."""

    def stats(self) -> tuple[int, int]:
        """(queried tokens, hit tokens) as counted by the manager itself."""


@dataclass
class DriveResult:
    requests: int
    prompt_blocks: int
    rejected_allocations: int
    queried_tokens: int
    hit_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


def drive(trace: Trace, mgr: ManagerAdapter) -> DriveResult:
    """Replay the trace: admit requests in order while fewer than max_running are in flight;
    each round gives every running request one decode step; a request whose prompt does not
    fit waits for the next round; a decode step that does not fit preempts the newest
    request (freed, re-queued at the front, recomputed from scratch - as vLLM's scheduler does).
    """
    bs = trace.block_size
    waiting = list(reversed(trace.requests))  # pop() from the end = FCFS
    running: list[list] = []  # [trace request, handle, decoded count]
    rejected = 0
    prompt_blocks = 0
    while waiting or running:
        while waiting and len(running) < trace.max_running:
            treq = waiting[-1]
            handle = mgr.start(treq)
            computed, num_hit = mgr.lookup(handle)
            num_new = len(treq.prompt) - num_hit
            if not mgr.allocate(handle, num_new, computed, num_hit):
                rejected += 1
                if not running:
                    raise RuntimeError(f"{treq.request_id} can never fit in {trace.num_blocks} blocks")
                break
            waiting.pop()
            prompt_blocks += len(treq.prompt) // bs
            mgr.advance(handle, num_hit + num_new, treq.output[0])
            running.append([treq, handle, 1])
        i = 0
        while i < len(running):
            treq, handle, done = running[i]
            if done == len(treq.output):
                mgr.free(handle)
                running.pop(i)
                continue
            if not mgr.allocate(handle, 1, None, 0):
                rejected += 1
                victim = running.pop()
                mgr.free(victim[1])
                waiting.append(victim[0])
                continue
            mgr.advance(handle, 1, treq.output[done])
            running[i][2] = done + 1
            i += 1
    queried, hits = mgr.stats()
    return DriveResult(len(trace.requests), prompt_blocks, rejected, queried, hits)
