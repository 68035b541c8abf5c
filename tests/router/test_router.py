"""Router policies and the prefix index: same-prefix requests land together, a saturated (or much
busier) replica sheds a hot prefix, a removed replica is forgotten; the index is fed by real KV
managers' events in vLLM's wire format; the cluster simulation on hand-made and real traces."""

from __future__ import annotations

import random

import pytest

from prefixkv.cache import KVCacheManager
from prefixkv.kv_events import encode_batch, to_int_hash
from prefixkv.replay import TraceRequest, load_mooncake
from prefixkv.replay.cli import main as replay_main
from prefixkv.replay.cluster import replay_cluster
from prefixkv.request import Request
from prefixkv.router import PrefixIndex, ReplicaLoad, make_router

BS = 4
IDLE = ReplicaLoad()


class Replica:
    """A real KV cache manager that publishes its events to the router's index in vLLM's wire format."""

    def __init__(self, rid: int, index: PrefixIndex) -> None:
        self.rid, self.index = rid, index
        self.mgr = KVCacheManager(num_blocks=8, block_size=BS, enable_kv_cache_events=True)
        self.n = 0

    def run(self, tokens: list[int]) -> int:
        self.n += 1
        req = Request(f"{self.rid}-{self.n}", tokens)
        hits, num_hit = self.mgr.get_computed_blocks(req)
        assert self.mgr.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
        self.mgr.free(req)
        self.index.apply_batch(self.rid, encode_batch(self.mgr.take_events(), to_int_hash))
        return num_hit

    def hashes(self, tokens: list[int]) -> list[int]:
        req = Request("probe", tokens)
        return [to_int_hash(h) for h in self.mgr.get_block_hashes(req)][: (len(tokens) - 1) // BS]


def _cluster(n: int):
    index = PrefixIndex("events")
    replicas = [Replica(i, index) for i in range(n)]
    for r in replicas:
        index.add_replica(r.rid)
    return index, replicas


A = list(range(100, 112))  # 3 blocks
B = list(range(200, 212))


def test_same_prefix_requests_land_together_and_hit():
    index, replicas = _cluster(3)
    ids = [r.rid for r in replicas]
    for name in ("prefix", "prefix-load"):
        router = make_router(name, index)
        placed = {}
        hits = 0
        for i, prefix in enumerate([A, B, A, B, A, A, B]):
            prompt = [*prefix, 1000 + i, 1001 + i]
            r = router.choose(replicas[0].hashes(prompt), ids, [IDLE] * 3)
            placed.setdefault(tuple(prefix), set()).add(r)
            hits += replicas[r].run(prompt)
        assert all(len(s) == 1 for s in placed.values())  # each prefix on one replica
        assert hits >= 5 * 12  # every repeat hit its 3 prefix blocks
    rr = make_router("round-robin")
    assert len({rr.choose([], ids, [IDLE] * 3) for _ in range(3)}) == 3


def test_saturated_or_much_busier_replica_sheds_a_hot_prefix():
    index, replicas = _cluster(3)
    ids = [0, 1, 2]
    replicas[0].run([*A, 1])
    h = replicas[0].hashes([*A, 2])
    assert index.match(h) == {0: 3}
    plr = make_router("prefix-load", index, max_queue=4, balance_abs=2, balance_rel=2.0)
    assert plr.choose(h, ids, [ReplicaLoad(queue=3), IDLE, IDLE]) != 0  # 3 > 2 x 0 + 2: much busier
    assert plr.choose(h, ids, [ReplicaLoad(queue=2), IDLE, IDLE]) == 0  # within the balance: affinity wins
    busy = [ReplicaLoad(queue=4), ReplicaLoad(queue=3), ReplicaLoad(queue=3)]
    assert plr.choose(h, ids, busy) != 0  # saturated (queue >= max_queue)
    assert plr.choose(h, ids, [ReplicaLoad(queue=1, kv_usage=0.99), ReplicaLoad(queue=1), IDLE]) == 2  # KV full
    everyone = [ReplicaLoad(queue=5), ReplicaLoad(queue=4), ReplicaLoad(queue=7)]
    assert plr.choose(h, ids, everyone) == 0  # all saturated, 0 within the balance gate: affinity
    everyone = [ReplicaLoad(queue=12), ReplicaLoad(queue=4), ReplicaLoad(queue=5)]
    assert plr.choose(h, ids, everyone) == 1  # ... 0 beyond it (12 > 2 x 4 + 2): the least loaded
    assert make_router("prefix", index).choose(h, ids, busy) == 0  # prefix alone never sheds


def test_removed_replica_is_forgotten_and_events_track_evictions():
    index, replicas = _cluster(2)
    replicas[0].run([*A, 1])
    replicas[1].run([*A, 1])
    h = replicas[0].hashes([*A, 2])
    assert index.match(h) == {0: 3, 1: 3}
    index.remove_replica(0)
    assert index.match(h) == {1: 3} and index.replicas == [1]
    assert make_router("prefix", index).choose(h, [1], [IDLE]) == 0  # position of replica 1
    # evictions reach the index: 8 blocks, two 3-block prompts of other content evict A's blocks
    replicas[1].run([*range(300, 312), 1])
    replicas[1].run([*range(400, 412), 1])
    assert index.match(h).get(1, 0) < 3
    replicas[1].mgr.reset_prefix_cache()
    index.apply_batch(1, encode_batch(replicas[1].mgr.take_events(), to_int_hash))
    assert index.match(h) == {} and index.num_blocks(1) == 0


def test_approximate_index_remembers_what_was_sent_within_capacity():
    index = PrefixIndex("approx", approx_capacity_blocks=4)
    index.record_sent("r0", ["a", "b", "c"])
    assert index.match(["a", "b", "x"]) == {"r0": 2}
    index.record_sent("r0", ["d", "e"])  # 5 > 4: the least recently sent ("a") is forgotten
    assert index.match(["a", "b"]) == {} and index.match(["b", "c"]) == {"r0": 2}
    with pytest.raises(ValueError, match="capacity"):
        PrefixIndex("approx")
    with pytest.raises(ValueError, match="unknown index mode"):
        PrefixIndex("guess")
    with pytest.raises(ValueError, match="unknown router 'random'"):
        make_router("random")
    with pytest.raises(ValueError, match="needs a PrefixIndex"):
        make_router("prefix")
    with pytest.raises(ValueError, match="no knobs"):
        make_router("round-robin", max_queue=3)
    with pytest.raises(ValueError, match="knobs"):
        make_router("prefix-load", PrefixIndex(), max_queue=0)


SPACED = 10_000_000


def test_cluster_simulation_prefix_routing_beats_round_robin_on_shared_prefixes():
    # 4 prefixes x 6 turns, 4 replicas of 8 blocks: one prefix per replica fits, all four do not
    prefixes = [list(range(1000 * p, 1000 * p + 12)) for p in range(4)]
    order = random.Random(0).choices(range(4), k=24)  # not aligned with round-robin's turns
    trace = [TraceRequest(t * SPACED, 14, 1, token_ids=(*prefixes[p], 7, 8)) for t, p in enumerate(order)]
    res = {
        r: replay_cluster(trace, 4, r, num_blocks=8, block_size=BS) for r in ("round-robin", "prefix", "prefix-load")
    }
    assert res["prefix"].hit_rate > res["round-robin"].hit_rate
    assert res["prefix-load"].hit_rate == res["prefix"].hit_rate  # idle replicas: the gate changes nothing
    bound = (24 - len(set(order))) * 12  # only each prefix's first request misses
    assert 0.9 * bound <= res["prefix"].hit_tokens <= bound
    for r in res.values():
        assert r.requests == 24 and sum(r.per_replica_requests) == 24 and len(r.ttft_ms) == 24
    approx = replay_cluster(trace, 4, "prefix", num_blocks=8, block_size=BS, index_mode="approx")
    assert approx.hit_tokens == res["prefix"].hit_tokens


def test_cluster_cli_on_the_shipped_trace(capsys):
    assert (
        replay_main(
            [
                "examples/traces/conversation_sample.jsonl",
                "--limit",
                "60",
                "--replicas",
                "2,8",
                "--num-blocks",
                "400",
                "--json",
            ]
        )
        == 0
    )
    import json

    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["num_replicas"], r["router"]) for r in rows] == [
        (n, r) for n in (2, 8) for r in ("round-robin", "prefix", "prefix-load")
    ]
    assert all(r["requests"] + r["skipped"] == 60 and r["ttft_p50_ms"] > 0 for r in rows)
    trace = load_mooncake("examples/traces/conversation_sample.jsonl", 60)
    assert rows[0]["prompt_tokens"] == sum(t.input_length for t in trace)
    assert replay_main(["examples/traces/conversation_sample.jsonl", "--replicas", "2", "--optimum"]) == 2


def test_pending_entries_cover_requests_not_admitted_yet():
    index = PrefixIndex("events")
    index.add_replica(0)
    index.add_pending(0, "req-1", ["a", "b"])
    assert index.match(["a", "b", "c"]) == {0: 2}  # sent, not admitted: the next turn follows it
    index.stored(0, ["a"])  # admitted: "a" cached; "b" was a hit elsewhere... or evicted at once
    index.resolve_pending("req-1")
    assert index.match(["a", "b"]) == {0: 1}
    index.add_pending(0, "req-2", ["x"])
    index.remove_replica(0)
    index.resolve_pending("req-2")  # the replica left meanwhile: nothing to do, nothing left
    assert index.match(["x"]) == {} and index.match(["a"]) == {}
    only = PrefixIndex("events-only")
    only.add_pending(0, "r", ["a"])
    assert only.match(["a"]) == {}
