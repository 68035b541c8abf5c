"""prompt_cache_key (OpenAI's hint that requests share a prefix) as a routing key: a key's
requests meet on one replica before any of their blocks are known, keys spread over the replicas,
a replica leaving moves only its own keys, a saturated replica still sheds, and what the index
knows of the prompt comes first."""

from __future__ import annotations

from prefixkv.router import PrefixIndex, ReplicaLoad, make_router

IDLE = ReplicaLoad()
REPLICAS = [0, 1, 2]
KEYS = [f"tenant-{i}" for i in range(12)]


def test_a_key_sticks_to_one_replica_and_keys_spread():
    for name in ("round-robin", "prefix", "prefix-load"):
        router = make_router(name, None if name == "round-robin" else PrefixIndex())
        homes = {k: {router.choose([], REPLICAS, [IDLE] * 3, k) for _ in range(5)} for k in KEYS}
        assert all(len(h) == 1 for h in homes.values()), name  # the same replica every time
        assert len({next(iter(h)) for h in homes.values()}) == 3, name  # twelve keys use all three


def test_a_replica_leaving_moves_only_its_keys():
    router = make_router("prefix", PrefixIndex())
    before = {k: router.choose([], REPLICAS, [IDLE] * 3, k) for k in KEYS}
    survivors = [0, 2]
    after = {k: survivors[router.choose([], survivors, [IDLE] * 2, k)] for k in KEYS}
    for k in KEYS:
        if before[k] != 1:
            assert after[k] == before[k], k


def test_a_saturated_home_sheds_and_the_index_comes_first():
    index = PrefixIndex()
    router = make_router("prefix-load", index, max_queue=2)
    key = KEYS[0]
    home = router.choose([], REPLICAS, [IDLE] * 3, key)
    busy = [ReplicaLoad(queue=2) if i == home else IDLE for i in REPLICAS]
    assert router.choose([], REPLICAS, busy, key) != home  # saturated: the gate sends it elsewhere
    other = (home + 1) % 3
    index.stored(other, [11, 12, 13])  # that replica holds the prompt's blocks
    assert router.choose([11, 12, 13], REPLICAS, [IDLE] * 3, key) == other
