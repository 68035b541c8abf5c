"""N engine replicas behind a router, simulated: `prefixkv replay TRACE --replicas N --router R`.

Each replica is a real KVCacheManager (simulator.ManagerBackend) with its own FCFS admission queue,
as in the single-pool replay. A request is routed when it arrives, by a prefixkv.router policy
that sees the request's chained block hashes (computed as the engine computes them) and every
replica's load; the router's PrefixIndex is fed by the replicas' own KV events (BlockStored /
BlockRemoved, as the engine publishes them) plus pending entries for requests sent but not yet
admitted (`index_mode="events"`), by the events alone ("events-only"), or by what it sent ("approx").

Time model (what the TTFT estimate rests on):
  * each replica prefills one request at a time, FCFS, at `prefill_tokens_per_s` over the prompt
    tokens its cache does not hold (cached tokens cost nothing); a request's prefill starts when
    it is admitted (its KV blocks allocated) and the replica's previous prefill has finished;
  * TTFT = end of its prefill - arrival (routing and queueing included, the first decode step not);
  * the request then decodes for `decode_ms_per_token` x output_length, overlapped with other
    requests' work, holding its blocks until it finishes (as in the single-pool replay);
  * the default prefill speed, 842 tokens/s, is what bench/model_speed.py measured for prefixkv's
    prefill of 1,024 tokens (SmolLM2-135M, float32, 2 CPU threads; docs/benchmarks.md "Model
    speed"). Scale it to your model and hardware: TTFTs scale with it, hit rates do not change.
Load imbalance: max / mean over replicas of the requests each received, and of the prefill tokens
each computed (1.0 = perfectly even).

A shared tier (`shared_tier_blocks`, a Redis every replica reads): every replica's pool evictions
enter it (LRU, tier.SharedTier), any replica's admission continues its prompt's chain there after
its pool hits, and a loaded token costs `tier_load_cost` of a computed one (default 0.05: the
default model's K and V are ~46 KB a token, ~50 us over a local Redis at ~1 GB/s, against ~1.2 ms
to compute it). The tier's stores and drops reach the router's index as medium REDIS events, so a
tier-aware router (router/index.py, `tier_discount`) counts them for every replica.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from prefixkv.cache import BlockRemoved, BlockStored, none_hash
from prefixkv.router import PrefixIndex, ReplicaLoad, make_router
from prefixkv.router.index import DEFAULT_TIER_DISCOUNT

from .simulator import ManagerBackend, TimeModel
from .tier import SharedTier, fast_block_hash
from .trace import TraceRequest

MEASURED_PREFILL_TOKENS_PER_S = 842.0  # bench/model_speed.py, prefill of 1,024 tokens (docs/benchmarks.md)
TIER_LOAD_COST = 0.05  # a token loaded from the shared tier, in computed tokens (module doc)
SHARED_MEDIUM = "REDIS"


@dataclass
class ClusterResult:
    router: str
    num_replicas: int
    num_blocks: int  # per replica
    block_size: int
    index_mode: str
    prefill_tokens_per_s: float
    requests: int = 0
    skipped: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    per_replica_requests: list[int] = field(default_factory=list)
    per_replica_prefill_tokens: list[int] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list, repr=False)
    seconds: float = 0.0
    shared_tier_blocks: int = 0
    tier_hit_tokens: int = 0  # prompt tokens loaded from the shared tier (not in hit_tokens)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def total_hit_rate(self) -> float:
        """Tokens not recomputed (pools + shared tier) / prompt tokens."""
        return (self.hit_tokens + self.tier_hit_tokens) / self.prompt_tokens if self.prompt_tokens else 0.0

    @staticmethod
    def _imbalance(values: Sequence[int]) -> float:
        mean = sum(values) / len(values) if values else 0.0
        return max(values) / mean if mean else 1.0

    @property
    def imbalance_requests(self) -> float:
        return self._imbalance(self.per_replica_requests)

    @property
    def imbalance_prefill(self) -> float:
        return self._imbalance(self.per_replica_prefill_tokens)

    def ttft_percentile(self, q: float) -> float:
        xs = sorted(self.ttft_ms)
        if not xs:
            return 0.0
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    @property
    def ttft_mean_ms(self) -> float:
        return sum(self.ttft_ms) / len(self.ttft_ms) if self.ttft_ms else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        del d["ttft_ms"]
        d.update(
            hit_rate=self.hit_rate,
            total_hit_rate=self.total_hit_rate,
            imbalance_requests=self.imbalance_requests,
            imbalance_prefill=self.imbalance_prefill,
            ttft_p50_ms=self.ttft_percentile(0.5),
            ttft_p90_ms=self.ttft_percentile(0.9),
            ttft_p99_ms=self.ttft_percentile(0.99),
            ttft_mean_ms=self.ttft_mean_ms,
        )
        return d


class _Replica:
    __slots__ = ("backend", "waiting", "running", "prefill_free_at", "prefill_ends")

    def __init__(self, backend: ManagerBackend) -> None:
        self.backend = backend
        self.waiting: deque[int] = deque()
        self.running = 0
        self.prefill_free_at = 0.0
        self.prefill_ends: list[float] = []  # heap: end of the prefill of admitted requests

    def load(self, now: float) -> ReplicaLoad:
        ends = self.prefill_ends
        while ends and ends[0] <= now:
            heapq.heappop(ends)
        b = self.backend
        return ReplicaLoad(len(self.waiting) + len(ends), self.running, b.blocks_in_use() / b.num_blocks)


def chain_hashes(req: TraceRequest, block_size: int, root: bytes) -> list[bytes]:
    """The engine's chained content hashes of the prompt's full blocks (fast_block_hash)."""
    ids = req.prompt_token_ids()
    out, parent = [], root
    for i in range(len(ids) // block_size):
        parent = fast_block_hash((parent, tuple(ids[i * block_size : (i + 1) * block_size]), None))
        out.append(parent)
    return out


def replay_cluster(
    trace: Sequence[TraceRequest],
    num_replicas: int,
    router: str,
    num_blocks: int,
    block_size: int = 512,
    policy: str = "lru",
    time_model: TimeModel | None = None,
    prefill_tokens_per_s: float = MEASURED_PREFILL_TOKENS_PER_S,
    index_mode: str = "events",
    shared_tier_blocks: int = 0,
    tier_discount: float = DEFAULT_TIER_DISCOUNT,
    tier_load_cost: float = TIER_LOAD_COST,
    **knobs: float,
) -> ClusterResult:
    """Route `trace` (sorted by timestamp) over `num_replicas` simulated replicas of `num_blocks`
    blocks each, with a shared tier of `shared_tier_blocks` below them (0: none); at the end every
    replica's blocks are free again (checked)."""
    if num_replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {num_replicas}")
    if prefill_tokens_per_s <= 0:
        raise ValueError("the prefill speed must be positive")
    if not 0.0 <= tier_load_cost <= 1.0:
        raise ValueError(f"the tier's load cost is a fraction of a computed token's, got {tier_load_cost}")
    tm = time_model or TimeModel()
    uses_index = router != "round-robin"
    index = (
        PrefixIndex(
            index_mode,
            approx_capacity_blocks=num_blocks if index_mode == "approx" else None,
            tier_discount=tier_discount,
        )
        if uses_index
        else None
    )
    chooser = make_router(router, index, **knobs)
    feed_events = uses_index and index_mode != "approx"
    shared = SharedTier(shared_tier_blocks) if shared_tier_blocks else None
    census: list[Counter[bytes]] = [Counter() for _ in range(num_replicas)]  # each pool's hashes
    replicas = [
        _Replica(ManagerBackend(num_blocks, block_size, policy, record_events=uses_index or shared is not None))
        for _ in range(num_replicas)
    ]
    chains: dict[int, list[bytes]] = {}  # request index -> its chain, while it waits
    ids = list(range(num_replicas))
    if index is not None:
        for r in ids:
            index.add_replica(r)
    root = none_hash(fast_block_hash, 0)
    res = ClusterResult(
        chooser.name, num_replicas, num_blocks, block_size, index_mode if uses_index else "-", prefill_tokens_per_s
    )
    res.shared_tier_blocks = shared_tier_blocks
    res.per_replica_requests = [0] * num_replicas
    res.per_replica_prefill_tokens = [0] * num_replicas
    ms_per_token = 1000.0 / prefill_tokens_per_s
    completions: list[tuple[float, int, int, int]] = []  # (end, seq, replica, request index)
    seq = 0
    t0 = time.perf_counter()

    def take_events(r: int, events: list) -> None:
        """A replica's pool events: to its census, the router's index and the shared tier."""
        pool = census[r]
        for ev in events:
            if isinstance(ev, BlockStored):
                pool.update(ev.block_hashes)
                if feed_events:
                    assert index is not None
                    index.stored(r, ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    pool[h] -= 1
                    if pool[h] <= 0:
                        del pool[h]
                if feed_events:
                    assert index is not None
                    index.removed(r, ev.block_hashes)
                if shared is not None:  # an eviction is offloaded to the shared tier
                    for h in ev.block_hashes:
                        new, dropped = shared.put(h)
                        if index is not None and feed_events:
                            if new:
                                index.tier_stored(r, SHARED_MEDIUM, [h])
                            if dropped is not None:
                                index.tier_removed(r, SHARED_MEDIUM, [dropped])

    def admit(r: int, now: float) -> None:
        nonlocal seq
        rep = replicas[r]
        backend = rep.backend
        while rep.waiting:
            idx = rep.waiting[0]
            req = trace[idx]
            foot = tm.footprint_tokens(req)
            if -(-foot // block_size) > num_blocks:
                rep.waiting.popleft()
                chains.pop(idx, None)
                res.skipped += 1
                if index is not None:
                    index.resolve_pending(idx)
                continue
            hit = backend.admit(idx, req, foot - req.input_length)
            if hit is None:
                return
            rep.waiting.popleft()
            chain = chains.pop(idx, [])
            loaded = 0
            if shared is not None:  # the chain goes on in the shared tier, under the engine's lookup rule
                first, stop = hit // block_size, (req.input_length - 1) // block_size
                if first < stop:
                    loaded = shared.continue_chain(chain, first, stop, census[r]) * block_size
            if backend.record_events:
                take_events(r, backend.mgr.take_events())
                if feed_events:
                    assert index is not None
                    index.resolve_pending(idx)
            computed = req.input_length - hit - loaded
            res.tier_hit_tokens += loaded
            start = max(now, rep.prefill_free_at)
            end = start + (computed + loaded * tier_load_cost) * ms_per_token
            rep.prefill_free_at = end
            heapq.heappush(rep.prefill_ends, end)
            res.requests += 1
            res.prompt_tokens += req.input_length
            res.hit_tokens += hit
            res.per_replica_prefill_tokens[r] += computed
            res.ttft_ms.append(end - req.timestamp_ms)
            rep.running += 1
            seq += 1
            heapq.heappush(completions, (end + tm.decode_ms_per_token * req.output_length, seq, r, idx))

    i, n = 0, len(trace)
    while i < n or completions:
        t_arrive = trace[i].timestamp_ms if i < n else float("inf")
        if completions and completions[0][0] <= t_arrive:
            now, _, r, idx = heapq.heappop(completions)
            replicas[r].backend.release(idx)
            replicas[r].running -= 1
            admit(r, now)
            continue
        req = trace[i]
        hashes: list[bytes] = chain_hashes(req, block_size, root) if uses_index or shared is not None else []
        lookup = hashes[: (req.input_length - 1) // block_size]  # the engine's lookup rule
        r = chooser.choose(lookup, ids, [rep.load(t_arrive) for rep in replicas])
        if index is not None:
            if index_mode == "approx":
                index.record_sent(r, hashes)
            else:
                index.add_pending(r, i, hashes)
        res.per_replica_requests[r] += 1
        if shared is not None:
            chains[i] = hashes
        replicas[r].waiting.append(i)
        i += 1
        if len(replicas[r].waiting) == 1:
            admit(r, t_arrive)
    for r, rep in enumerate(replicas):
        if rep.waiting or rep.backend.mgr.num_free_blocks != num_blocks:
            raise AssertionError(f"replica {r}: requests left waiting or blocks still held after the replay")
    res.seconds = time.perf_counter() - t0
    return res
