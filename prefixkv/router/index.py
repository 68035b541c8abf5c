"""Which replica holds which blocks, by chained block hash: the router's view of the caches.

Two ways to keep it:
  * precise (`mode="events"`): fed by each replica's KV events - vLLM's BlockStored / BlockRemoved /
    AllBlocksCleared, as prefixkv's publisher (prefixkv/kv_events) and vLLM send them. A hash is on
    a replica while its stored count there is positive (a replica may cache two copies of a block,
    and evicts each with its own BlockRemoved). `apply_batch()` decodes a wire payload; the
    simulator calls stored() / removed() directly.
  * approximate (`mode="approx"`, the fallback without events): the router assumes a replica
    caches the blocks of every request it sent there, and forgets them LRU beyond the replica's
    capacity in blocks (it cannot see evictions).
  * in flight (`events` mode, not `events-only`): events arrive only when a replica admits a
    request, which under load is long after the router sent it; meanwhile the next turn of the
    same conversation would not find its prefix anywhere. So the router also records what it sent
    as *pending* entries of that replica (`add_pending`), until the replica has taken the request
    (`resolve_pending`: in the simulator at admission, live at the first token) - by then its
    BlockStored events have named the blocks for real. (`replay --router-index` compares the three.)
A replica that leaves (killed, or a gap in its event stream that replay cannot fill) is dropped
with `remove_replica()`: its blocks are forgotten at once, so nothing is routed there for them.

Tiers: events of a lower tier (medium CPU, DISK, REDIS - prefixkv/tiers publishes them) are kept
apart from the pool's. A block in a replica's own CPU or DISK tier can be loaded by that replica,
a block in a shared tier (`shared_mediums`, REDIS by default: every replica reads the same Redis)
by every replica; either is cheaper than recomputing it but not free, so `match` counts it as
`tier_discount` of a pool block (vLLM's and SGLang's routers count pool blocks only; Dynamo's
discounts blocks in a shared pool the same way). Until a tier event arrives, `match` is the plain
pool match.

Pure Python, no prefixkv imports beyond the standard library and msgpack (for `apply_batch`): the same object can sit
behind Ray Serve or any other front end.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

try:
    import msgpack
except ImportError:  # only `apply_payload` reads ZeroMQ payloads; it names the extra
    msgpack = None

BlockHash = Hashable  # bytes or int (vLLM's ExternalBlockHash), whatever the replicas publish
ReplicaId = Hashable
MODES = ("events", "events-only", "approx")


DEFAULT_TIER_DISCOUNT = 0.5
SHARED_MEDIUMS = ("REDIS",)


class PrefixIndex:
    def __init__(
        self,
        mode: str = "events",
        approx_capacity_blocks: int | None = None,
        *,
        tier_discount: float = DEFAULT_TIER_DISCOUNT,
        shared_mediums: Iterable[str] = SHARED_MEDIUMS,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown index mode {mode!r}; choose one of {', '.join(MODES)}")
        if mode == "approx" and (approx_capacity_blocks is None or approx_capacity_blocks < 1):
            raise ValueError("the approximate index needs each replica's capacity in blocks (>= 1)")
        if not 0.0 <= tier_discount <= 1.0:
            raise ValueError(f"tier_discount must be in [0, 1] (a pool block counts 1), got {tier_discount}")
        self.mode = mode
        self.tier_discount = tier_discount
        self.shared_mediums = frozenset(shared_mediums)
        self._own_tiers: dict[ReplicaId, Counter[BlockHash]] = {}  # a replica's CPU/DISK tier copies
        self._shared_tier: Counter[BlockHash] = Counter()  # copies in a tier every replica reads
        self.approx_capacity_blocks = approx_capacity_blocks
        self._holders: dict[BlockHash, set[ReplicaId]] = {}  # hash -> replicas holding it
        self._counts: dict[ReplicaId, Counter[BlockHash]] = {}  # events mode: copies per replica
        self._lru: dict[ReplicaId, OrderedDict[BlockHash, None]] = {}  # approx mode
        self._pending: dict[ReplicaId, Counter[BlockHash]] = {}  # events mode: sent, not yet admitted
        self._inflight: dict[Hashable, tuple[ReplicaId, Sequence[BlockHash]]] = {}

    # -- membership -----------------------------------------------------------------------------
    @property
    def replicas(self) -> list[ReplicaId]:
        return list(self._lru if self.mode == "approx" else self._counts)

    def add_replica(self, replica: ReplicaId) -> None:
        if self.mode == "approx":
            self._lru.setdefault(replica, OrderedDict())
        else:
            self._counts.setdefault(replica, Counter())

    def remove_replica(self, replica: ReplicaId) -> None:
        """Forget every block of the replica (it left, or its event stream has a hole)."""
        blocks: list[BlockHash] = list(
            self._lru.pop(replica, OrderedDict()) if self.mode == "approx" else self._counts.pop(replica, Counter())
        )
        blocks += self._pending.pop(replica, Counter())
        self._own_tiers.pop(replica, None)  # its own tiers leave with it; a shared tier stays
        holders = self._holders
        for h in blocks:
            s = holders.get(h)
            if s is not None:
                s.discard(replica)
                if not s:
                    del holders[h]

    def num_blocks(self, replica: ReplicaId) -> int:
        return len(self._lru.get(replica, ())) if self.mode == "approx" else len(self._counts.get(replica, ()))

    # -- events mode ----------------------------------------------------------------------------
    def stored(self, replica: ReplicaId, hashes: Iterable[BlockHash]) -> None:
        counts = self._counts.setdefault(replica, Counter())
        holders = self._holders
        for h in hashes:
            if counts[h] == 0:
                holders.setdefault(h, set()).add(replica)
            counts[h] += 1

    def removed(self, replica: ReplicaId, hashes: Iterable[BlockHash]) -> None:
        counts = self._counts.get(replica)
        if counts is None:
            return
        for h in hashes:
            c = counts.get(h, 0)
            if c > 1:
                counts[h] = c - 1
            elif c == 1:
                del counts[h]
                if h not in self._pending.get(replica, ()):
                    self._drop_holder(h, replica)

    def _drop_holder(self, h: BlockHash, replica: ReplicaId) -> None:
        s = self._holders[h]
        s.discard(replica)
        if not s:
            del self._holders[h]

    def add_pending(self, replica: ReplicaId, request_id: Hashable, hashes: Sequence[BlockHash]) -> None:
        """The router sent request `request_id` with these block hashes to the replica (events mode;
        nothing in events-only mode)."""
        if self.mode != "events":
            return
        pending = self._pending.setdefault(replica, Counter())
        holders = self._holders
        for h in hashes:
            if not pending[h]:
                holders.setdefault(h, set()).add(replica)
            pending[h] += 1
        self._inflight[request_id] = (replica, hashes)

    def resolve_pending(self, request_id: Hashable) -> None:
        """The replica took the request (its KV events now speak for its blocks)."""
        entry = self._inflight.pop(request_id, None)
        if entry is None:
            return
        replica, hashes = entry
        pending = self._pending.get(replica)
        if pending is None:  # the replica left meanwhile
            return
        counts = self._counts.get(replica, Counter())
        for h in hashes:
            c = pending[h] - 1
            if c > 0:
                pending[h] = c
                continue
            del pending[h]
            if not counts.get(h):
                self._drop_holder(h, replica)

    def cleared(self, replica: ReplicaId) -> None:
        """The replica's KV pool was cleared (its lower tiers keep what they hold)."""
        own = self._own_tiers.get(replica)
        self.remove_replica(replica)
        self.add_replica(replica)
        if own is not None:
            self._own_tiers[replica] = own

    def apply_events(self, replica: ReplicaId, events: Sequence[dict[str, Any]]) -> None:
        """Decoded vLLM events (maps tagged by "type"). The KV pool's (medium "GPU" or absent) say
        what the replica can hit; a lower tier's (CPU, DISK, REDIS) what it - or, for a shared
        tier, any replica - can load (`tier_stored`)."""
        for ev in events:
            if ev.get("group_idx") not in (None, 0):
                continue  # a hybrid model's sliding-window group: group 0's blocks name the prefix
            kind = ev.get("type")
            medium = ev.get("medium", "GPU")
            if kind == "AllBlocksCleared":
                if medium in (None, "GPU"):
                    self.cleared(replica)
            elif medium not in (None, "GPU"):
                if kind == "BlockStored":
                    self.tier_stored(replica, medium, ev["block_hashes"])
                elif kind == "BlockRemoved":
                    self.tier_removed(replica, medium, ev["block_hashes"])
            elif kind == "BlockStored":
                self.stored(replica, ev["block_hashes"])
            elif kind == "BlockRemoved":
                self.removed(replica, ev["block_hashes"])

    # -- lower tiers ----------------------------------------------------------------------------
    def _tier(self, replica: ReplicaId, medium: str) -> Counter[BlockHash]:
        if medium in self.shared_mediums:
            return self._shared_tier
        return self._own_tiers.setdefault(replica, Counter())

    def tier_stored(self, replica: ReplicaId, medium: str, hashes: Iterable[BlockHash]) -> None:
        """The replica stored these blocks in its tier `medium` (shared: in the tier all read)."""
        tier = self._tier(replica, medium)
        for h in hashes:
            tier[h] += 1

    def tier_removed(self, replica: ReplicaId, medium: str, hashes: Iterable[BlockHash]) -> None:
        tier = self._tier(replica, medium)
        for h in hashes:
            c = tier.get(h, 0)
            if c > 1:
                tier[h] = c - 1
            elif c == 1:
                del tier[h]

    def num_tier_blocks(self, replica: ReplicaId | None = None) -> int:
        """Blocks in the replica's own tiers, or (None) in the shared tier."""
        return len(self._shared_tier if replica is None else self._own_tiers.get(replica, ()))

    def apply_batch(self, replica: ReplicaId, payload: bytes) -> None:
        """One ZeroMQ payload: msgpack [ts, events, data_parallel_rank]."""
        if msgpack is None:
            raise ImportError("reading KV event payloads needs msgpack: pip install 'prefixkv[kv-events]'")
        batch = msgpack.unpackb(payload, raw=False)
        self.apply_events(replica, batch[1])

    # -- approximate mode -----------------------------------------------------------------------
    def record_sent(self, replica: ReplicaId, hashes: Sequence[BlockHash]) -> None:
        """The router sent a request with these block hashes to the replica (approx mode)."""
        lru = self._lru.setdefault(replica, OrderedDict())
        holders = self._holders
        cap = self.approx_capacity_blocks or 0
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                holders.setdefault(h, set()).add(replica)
        while len(lru) > cap:
            old, _ = lru.popitem(last=False)
            s = holders[old]
            s.discard(replica)
            if not s:
                del holders[old]

    # -- queries --------------------------------------------------------------------------------
    def match(self, hashes: Sequence[BlockHash]) -> dict[ReplicaId, float]:
        """For every replica that can serve block 0 of the chain: how many leading blocks it holds
        - a block only a tier holds (its own, or the shared one) counting `tier_discount`."""
        if self._shared_tier or any(self._own_tiers.values()):
            return self._match_with_tiers(hashes)
        return self._match_pool(hashes)

    def _match_with_tiers(self, hashes: Sequence[BlockHash]) -> dict[ReplicaId, float]:
        holders, shared, discount = self._holders, self._shared_tier, self.tier_discount
        result: dict[ReplicaId, float] = {}
        for replica in self.replicas:
            own = self._own_tiers.get(replica, Counter())
            score = 0.0
            for h in hashes:
                here = holders.get(h)
                if here is not None and replica in here:
                    score += 1.0
                elif h in shared or h in own:
                    score += discount
                else:
                    break
            if score:
                result[replica] = score
        return result

    def _match_pool(self, hashes: Sequence[BlockHash]) -> dict[ReplicaId, float]:
        holders = self._holders
        first = holders.get(hashes[0]) if hashes else None
        if not first:
            return {}
        alive = set(first)
        result: dict[ReplicaId, float] = {}
        for depth in range(1, len(hashes)):
            here = holders.get(hashes[depth])
            if here is None:
                break
            dropped = alive - here
            if dropped:
                for r in dropped:
                    result[r] = depth
                alive &= here
                if not alive:
                    break
        else:
            depth = len(hashes)
        for r in alive:
            result[r] = depth
        return result
