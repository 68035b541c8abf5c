"""The index knows the tiers: blocks a replica can load from its own CPU/DISK tier, or any replica
from the shared Redis tier, count at a discount, so a request goes where the least is computed."""

import pytest

from prefixkv.router import PrefixIndex, ReplicaLoad, make_router

CHAIN = ["h0", "h1", "h2", "h3"]
IDLE = [ReplicaLoad(), ReplicaLoad()]


def stored(medium, hashes):
    return {"type": "BlockStored", "block_hashes": hashes, "medium": medium}


def removed(medium, hashes):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def two_replicas(**knobs):
    index = PrefixIndex("events", **knobs)
    index.add_replica("a")
    index.add_replica("b")
    return index


def test_without_tier_events_the_match_is_the_pools():
    index = two_replicas()
    index.apply_events("a", [stored("GPU", CHAIN[:2])])
    assert index.match(CHAIN) == {"a": 2}


def test_a_replicas_own_tier_counts_for_it_alone_at_the_discount():
    index = two_replicas(tier_discount=0.25)
    index.apply_events("a", [stored("GPU", CHAIN[:1]), stored("DISK", CHAIN)])
    assert index.match(CHAIN) == {"a": 1 + 3 * 0.25}
    router = make_router("prefix", index)
    assert all(router.choose(CHAIN, ["a", "b"], IDLE) == 0 for _ in range(4))  # not in turn: a's disk


def test_the_shared_tier_counts_for_every_replica():
    index = two_replicas()
    index.apply_events("a", [stored("GPU", CHAIN[:1]), stored("REDIS", CHAIN)])
    assert index.match(CHAIN) == {"a": 2.5, "b": 2.0}  # b loads all four from Redis
    router = make_router("prefix", index)
    assert router.choose(CHAIN, ["a", "b"], IDLE) == 0  # a computes least (one pool hit)
    # a busy: prefix-load sends it to b, which loads the shared blocks instead of recomputing them
    busy = [ReplicaLoad(queue=9), ReplicaLoad()]
    assert make_router("prefix-load", index).choose(CHAIN, ["a", "b"], busy) == 1
    assert index.match(["h0", "zz"]) == {"a": 1.0, "b": 0.5}  # a chain stops at its first miss


def test_tier_removals_a_replica_leaving_and_a_pool_clear():
    index = two_replicas()
    index.apply_events("a", [stored("REDIS", CHAIN), stored("CPU", ["x0"]), stored("GPU", ["x0"])])
    index.apply_events("b", [removed("REDIS", CHAIN[2:])])
    assert index.match(CHAIN) == {"a": 1.0, "b": 1.0}
    index.apply_events("a", [{"type": "AllBlocksCleared", "medium": "GPU"}])
    assert index.match(["x0"]) == {"a": 0.5}  # the pool cleared, its CPU tier still holds it
    index.remove_replica("a")
    assert index.num_tier_blocks("a") == 0 and index.num_tier_blocks() == 2  # the shared tier stays
    assert index.match(CHAIN) == {"b": 1.0}


def test_discount_bounds():
    with pytest.raises(ValueError, match="tier_discount"):
        PrefixIndex("events", tier_discount=1.5)
    index = two_replicas(tier_discount=0.0)
    index.apply_events("a", [stored("REDIS", CHAIN)])
    assert index.match(CHAIN) == {}  # a tier worth nothing: the pool match alone


def test_cluster_simulation_with_a_shared_tier_loads_what_round_robin_scattered():
    import random

    from prefixkv.replay.cluster import replay_cluster
    from prefixkv.replay.trace import TraceRequest

    bs = 4
    # 6 prefixes of 3 blocks, 4 replicas of 6 blocks: round-robin scatters every prefix over the
    # replicas and their pools evict it; a shared tier keeps the evicted blocks for every replica
    prefixes = [list(range(1000 * p, 1000 * p + 12)) for p in range(6)]
    order = random.Random(1).choices(range(6), k=48)
    trace = [TraceRequest(t * 10_000_000, 14, 1, token_ids=(*prefixes[p], 7, 8)) for t, p in enumerate(order)]
    plain = replay_cluster(trace, 4, "round-robin", num_blocks=6, block_size=bs)
    shared = replay_cluster(trace, 4, "round-robin", num_blocks=6, block_size=bs, shared_tier_blocks=64)
    assert plain.tier_hit_tokens == 0 and shared.tier_hit_tokens > 0
    assert shared.total_hit_rate > plain.total_hit_rate
    assert sum(shared.ttft_ms) < sum(plain.ttft_ms)  # a loaded token costs tier_load_cost of a computed one
    routed = replay_cluster(trace, 4, "prefix", num_blocks=6, block_size=bs, shared_tier_blocks=64)
    assert routed.requests == 48 and routed.total_hit_rate >= shared.total_hit_rate
    with pytest.raises(ValueError, match="load cost"):
        replay_cluster(trace, 2, "prefix", num_blocks=6, block_size=bs, tier_load_cost=2.0)


def test_a_hybrid_models_later_groups_do_not_move_the_index():
    """A sliding-window group's blocks carry group 0's hashes (vLLM's rule); its stores and its
    removals as the window moves on say nothing of whether the prefix is cached."""
    index = two_replicas()
    index.apply_events("a", [stored("GPU", CHAIN), {**stored("GPU", CHAIN), "group_idx": 1}])
    index.apply_events("a", [{**removed("GPU", CHAIN), "group_idx": 1}])
    assert index.match(CHAIN) == {"a": 4}
    index.apply_events("a", [{**removed("GPU", CHAIN[2:]), "group_idx": 0}])
    assert index.match(CHAIN) == {"a": 2}
