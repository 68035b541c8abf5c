"""Replay a trace through the real KVCacheManager at a chosen cache size, block size and eviction
policy.

Time model (TimeModel; see docs/replay.md):
  * A request arrives at its trace timestamp and joins one FCFS queue. The head of the queue is
    admitted as soon as the pool can supply its blocks: one cache lookup (get_computed_blocks),
    then allocate_slots for the whole prompt plus, by default, `output_length` lookahead slots -
    the request holds its peak footprint (prompt + output) from admission to completion. If the
    head does not fit it waits (and so does everyone behind it) until a completion frees blocks.
  * It holds its blocks for `prefill_ms_per_token * input_length + decode_ms_per_token *
    output_length` (defaults 0.05 ms and 20 ms), then frees them (tail first, as the engine does).
    The hold time does not depend on the hit count, so every policy faces the same work; only
    memory (sharing of held blocks) can shift admissions between policies.
  * Generated tokens are not appended: the trace carries no output content, so their blocks are
    reserved (uncached, like the partial last prompt block) but never hashed.
  * A request whose footprint exceeds the whole pool can never run; it is skipped and counted.

Hit rate is token-weighted: prompt tokens served from the cache at admission / prompt tokens, over
admitted requests. The lookup rule is the engine's: whole blocks, at most input_length - 1 tokens.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

from prefixkv.cache import EvictionPolicy, KVCacheManager, PinError, get_policy
from prefixkv.request import Request

from .pins import hot_prefixes
from .tier import CPUTier, fast_block_hash
from .trace import TraceRequest


@dataclass(frozen=True)
class TimeModel:
    prefill_ms_per_token: float = 0.05
    decode_ms_per_token: float = 20.0
    reserve_output: bool = True  # hold slots for output_length generated tokens

    def hold_ms(self, req: TraceRequest) -> float:
        return self.prefill_ms_per_token * req.input_length + self.decode_ms_per_token * req.output_length

    def footprint_tokens(self, req: TraceRequest) -> int:
        return req.input_length + (req.output_length if self.reserve_output else 0)


@dataclass
class ReplayResult:
    policy: str
    num_blocks: int
    block_size: int
    requests: int = 0  # admitted
    skipped: int = 0  # larger than the whole pool
    prompt_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    peak_blocks_in_use: int = 0
    waited: int = 0  # requests admitted later than their arrival
    mean_wait_ms: float = 0.0
    max_queue: int = 0
    seconds: float = 0.0
    cpu_tier_blocks: int = 0  # 0: no tier below the pool
    tier_hit_tokens: int = 0  # prompt tokens loaded from the tier (not counted in hit_tokens)
    pinned_prefixes: int = 0  # pinned by --pin-top (pins.py)
    pinned_blocks: int = 0
    pins_refused: int = 0  # past --max-pinned-fraction
    extra: dict = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        """Tokens served from the pool / prompt tokens."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def tier_hit_rate(self) -> float:
        return self.tier_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def total_hit_rate(self) -> float:
        """Tokens not recomputed (pool + tier) / prompt tokens."""
        return (self.hit_tokens + self.tier_hit_tokens) / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def peak_usage(self) -> float:
        return self.peak_blocks_in_use / self.num_blocks

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(
            hit_rate=self.hit_rate,
            tier_hit_rate=self.tier_hit_rate,
            total_hit_rate=self.total_hit_rate,
            peak_usage=self.peak_usage,
        )
        return d


class Backend(Protocol):
    """What the shared schedule needs of a cache: admit (returns hit tokens, or None when the
    request does not fit now - changing nothing), release, and blocks in use. A backend with a
    tier below the pool sets `last_tier_hit` (tokens) at each successful admit."""

    num_blocks: int
    last_tier_hit: int

    def admit(self, index: int, req: TraceRequest, lookahead: int) -> int | None: ...

    def release(self, index: int) -> None: ...

    def blocks_in_use(self) -> int: ...

    def evictions(self) -> int: ...


def run_schedule(
    trace: Sequence[TraceRequest], backend: Backend, block_size: int, time_model: TimeModel, result: ReplayResult
) -> ReplayResult:
    """The admission/hold schedule shared by the real-manager replay and the offline optimum.
    `trace` must be sorted by timestamp; admission is FCFS in trace order."""
    t0 = time.perf_counter()
    n = len(trace)
    waiting: deque[int] = deque()
    running: list[tuple[float, int]] = []
    num_blocks = backend.num_blocks
    total_wait = 0.0
    i = 0

    def try_admit(now: float) -> None:
        nonlocal total_wait
        while waiting:
            idx = waiting[0]
            req = trace[idx]
            foot = time_model.footprint_tokens(req)
            if -(-foot // block_size) > num_blocks:
                waiting.popleft()
                result.skipped += 1
                continue
            lookahead = foot - req.input_length
            hit = backend.admit(idx, req, lookahead)
            if hit is None:
                return
            waiting.popleft()
            result.requests += 1
            result.prompt_tokens += req.input_length
            result.hit_tokens += hit
            result.tier_hit_tokens += backend.last_tier_hit
            wait = now - req.timestamp_ms
            if wait > 0:
                result.waited += 1
                total_wait += wait
            heapq.heappush(running, (now + time_model.hold_ms(req), idx))
            used = backend.blocks_in_use()
            if used > result.peak_blocks_in_use:
                result.peak_blocks_in_use = used

    while i < n or running:
        t_arrive = trace[i].timestamp_ms if i < n else float("inf")
        if running and running[0][0] <= t_arrive:
            now, idx = heapq.heappop(running)
            backend.release(idx)
            try_admit(now)
        else:
            waiting.append(i)
            i += 1
            if len(waiting) > result.max_queue:
                result.max_queue = len(waiting)
            if len(waiting) == 1:  # otherwise the head is blocked and FCFS keeps this one waiting
                try_admit(t_arrive)
    if waiting:  # cannot happen: with nothing running the head always fits or is skipped
        raise RuntimeError(f"{len(waiting)} requests left waiting with nothing running")
    result.evictions = backend.evictions()
    result.mean_wait_ms = total_wait / result.requests if result.requests else 0.0
    result.seconds = time.perf_counter() - t0
    return result


class _TraceRequest(Request):
    """A replayed request: its generated tokens are counted (policies that learn from finished
    requests see the output length) but not stored, since the trace has no output content."""

    num_generated = 0

    @property
    def num_output_tokens(self) -> int:
        return self.num_generated


class ManagerBackend:
    """The real thing: prefixkv.cache.KVCacheManager driven with prefixkv.request.Request."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        policy: str | type[EvictionPolicy] = "lru",
        cpu_tier_blocks: int = 0,
        record_events: bool = False,
        pins: Sequence[tuple[int, ...]] = (),
        max_pinned_fraction: float = 0.5,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.tier = CPUTier(cpu_tier_blocks) if cpu_tier_blocks else None
        self.last_tier_hit = 0
        self.record_events = record_events  # the caller drains mgr.take_events() (a router's index)
        if self.tier is None and not record_events:
            self.mgr = KVCacheManager(
                num_blocks,
                block_size,
                enable_caching=True,
                eviction_policy=policy,
                max_pinned_fraction=max_pinned_fraction,
            )
        else:  # the tier learns the pool's evictions from its KV events, keyed by content hash
            self.mgr = KVCacheManager(
                num_blocks,
                block_size,
                enable_caching=True,
                eviction_policy=policy,
                hash_algo=fast_block_hash,
                enable_kv_cache_events=True,
                max_pinned_fraction=max_pinned_fraction,
            )
        # prefixes to pin once cached, by their first block (pins.py); each is tried once
        self._to_pin = {prefix[:block_size]: prefix for prefix in pins}
        self.pins_refused = 0
        self._live: dict[int, Request] = {}
        self._head: tuple[int, Request] | None = None  # a request that did not fit yet

    def admit(self, index: int, req: TraceRequest, lookahead: int) -> int | None:
        if self._head is not None and self._head[0] == index:
            request = self._head[1]
        else:
            request = _TraceRequest(str(index), req.prompt_token_ids(), arrival_time=req.timestamp_ms / 1e3)
            request.num_generated = req.output_length
        mgr = self.mgr
        hits, num_hit = mgr.get_computed_blocks(request)
        tier = self.tier
        if tier is not None:  # continue the chain in the tier, under the engine's lookup rule
            bs = self.block_size
            stop = (req.input_length - 1) // bs
            start = num_hit // bs
            tier_blocks = tier.continue_chain(mgr.get_block_hashes(request), start, stop) if start < stop else 0
        if mgr.allocate_slots(request, request.num_tokens - num_hit, hits, num_lookahead_tokens=lookahead) is None:
            if tier is not None:
                tier.num_hit_blocks -= tier_blocks  # not admitted: counted again when it is
            self._head = (index, request)
            return None
        self._head = None
        if tier is not None:
            self.last_tier_hit = tier_blocks * self.block_size
            if not self.record_events:
                tier.on_events(mgr.take_events())
        request.num_computed_tokens = request.num_tokens
        request.num_cached_tokens = num_hit
        self._live[index] = request
        if self._to_pin:
            self._pin_if_named(request)
        return num_hit

    def _pin_if_named(self, request: Request) -> None:
        first = tuple(request.all_token_ids[: self.block_size])
        prefix = self._to_pin.get(first)
        if prefix is None or list(prefix) != request.all_token_ids[: len(prefix)]:
            return  # not named, or it shares the first block only: wait for a request that has all
        del self._to_pin[first]
        try:
            self.mgr.pin(_TraceRequest("pin", list(prefix)))
        except PinError:
            self.pins_refused += 1

    def release(self, index: int) -> None:
        self.mgr.free(self._live.pop(index))

    def blocks_in_use(self) -> int:
        return self.num_blocks - self.mgr.num_free_blocks

    def evictions(self) -> int:
        return self.mgr.block_pool.num_evictions


def replay(
    trace: Sequence[TraceRequest],
    num_blocks: int,
    block_size: int = 512,
    policy: str | type[EvictionPolicy] = "lru",
    time_model: TimeModel | None = None,
    cpu_tier_blocks: int = 0,
    pin_top: int = 0,
    max_pinned_fraction: float = 0.5,
) -> ReplayResult:
    """Replay `trace` (sorted by timestamp) through a fresh KVCacheManager, with a CPU tier of
    `cpu_tier_blocks` below it (tier.py; 0: none) and the `pin_top` hottest prefixes pinned (pins.py;
    0: none); at the end every block is free again (checked)."""
    time_model = time_model or TimeModel()
    policy_cls = get_policy(policy)
    pins = hot_prefixes(trace, block_size, pin_top)
    backend = ManagerBackend(
        num_blocks, block_size, policy_cls, cpu_tier_blocks, pins=pins, max_pinned_fraction=max_pinned_fraction
    )
    result = ReplayResult(policy_cls.name, num_blocks, block_size, cpu_tier_blocks=cpu_tier_blocks)
    run_schedule(trace, backend, block_size, time_model, result)
    mgr = backend.mgr
    result.pinned_prefixes, result.pinned_blocks = len(mgr.pins), mgr.pins.num_pinned_blocks
    result.pins_refused = backend.pins_refused
    mgr.unpin_all()
    if backend.mgr.num_free_blocks != num_blocks:
        raise AssertionError(f"{num_blocks - backend.mgr.num_free_blocks} blocks still held after replay")
    return result
