"""The replay simulator and the offline optimum on hand-made traces."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixkv.cache import POLICIES
from prefixkv.replay import TimeModel, TraceRequest, replay, replay_optimum
from prefixkv.replay.optimum import infinite_cache_hit_rate

SPACED = 10_000_000  # ms between requests: nothing overlaps


def tok(ts, tokens, out=0):
    return TraceRequest(ts, len(tokens), out, token_ids=tuple(tokens))


def test_known_hit_rate_sequential():
    trace = [tok(0, range(9)), tok(SPACED, range(9)), tok(2 * SPACED, [0, 1, 2, 3, 100, 101, 102, 103, 104])]
    for policy in POLICIES:
        r = replay(trace, num_blocks=16, block_size=4, policy=policy)
        # r1 hits 2 blocks (8 of 9 tokens; the last token is always computed); r2 hits 1 block
        assert (r.hit_tokens, r.prompt_tokens, r.requests) == (12, 27, 3)
        assert r.evictions == 0 and r.waited == 0
    assert replay_optimum(trace, 16, 4).hit_tokens == 12
    assert abs(infinite_cache_hit_rate(trace, 4) - 12 / 27) < 1e-12


def test_mooncake_ids_exercise_the_real_hash_path():
    trace = [
        TraceRequest(0, 1000, 10, hash_ids=(1, 2)),
        TraceRequest(SPACED, 1100, 10, hash_ids=(1, 2, 3)),
        TraceRequest(2 * SPACED, 1100, 10, hash_ids=(1, 4, 5)),
    ]
    r = replay(trace, num_blocks=64, block_size=512)
    assert r.hit_tokens == 512 + 512  # r0 cached only id 1 (its id 2 is partial); r2 shares id 1
    r128 = replay(trace, num_blocks=64, block_size=128)
    assert r128.hit_tokens == (1000 // 128) * 128 + 512  # r1 hits r0's 7 full blocks


def test_capacity_pressure_fcfs_wait_and_skip():
    tm = TimeModel(prefill_ms_per_token=0.0, decode_ms_per_token=1.0, reserve_output=True)
    # 4 blocks of 4 tokens; each request needs 3 blocks (8 prompt + 4 output tokens)
    trace = [
        tok(0, range(8), out=4),
        tok(0, range(50, 58), out=4),
        tok(1, range(200, 300), out=1),
        tok(2, range(8), out=4),
    ]
    r = replay(trace, num_blocks=4, block_size=4, time_model=tm)
    assert r.skipped == 1 and r.requests == 3  # the 100-token prompt never fits
    assert r.waited == 2 and r.peak_blocks_in_use == 3 and r.max_queue >= 2
    assert r.evictions >= 1
    o = replay_optimum(trace, 4, 4, tm)
    assert (o.skipped, o.requests, o.peak_blocks_in_use) == (1, 3, 3)


def test_held_blocks_are_shared():
    tm = TimeModel(0.0, 1000.0)
    trace = [tok(0, range(13), out=1), tok(1, range(13), out=1)]  # each holds 4 blocks
    r = replay(trace, num_blocks=8, block_size=4, time_model=tm)
    assert r.hit_tokens == 12 and r.peak_blocks_in_use == 5 and r.waited == 0


blocks = st.lists(st.integers(0, 3), min_size=1, max_size=4)  # token "words" -> shared prefixes


@st.composite
def traces(draw):
    n = draw(st.integers(2, 25))
    out, t = [], 0
    for _ in range(n):
        t += draw(st.integers(0, 40))
        prefix = draw(st.lists(st.integers(0, 4), min_size=1, max_size=5))
        tokens = [x for w in prefix for x in (w, w + 10)]  # blocks of 2 tokens per word
        tokens += draw(st.lists(st.integers(20, 22), max_size=2))
        out.append(tok(t, tokens, out=draw(st.integers(0, 3))))
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces(), num_blocks=st.integers(3, 12), reserve=st.booleans())
def test_optimum_bounds_every_policy_and_nothing_leaks(trace, num_blocks, reserve):
    tm = TimeModel(0.0, 10.0, reserve)
    opt = replay_optimum(trace, num_blocks, 2, tm)
    ceiling = infinite_cache_hit_rate(trace, 2)
    oracle = replay_optimum(trace, num_blocks, 2, tm, reuse_oracle=True)
    assert oracle.hit_tokens <= opt.hit_tokens
    for policy in POLICIES:
        r = replay(trace, num_blocks, 2, policy, tm)  # raises if any block is still held
        assert r.requests + r.skipped == len(trace)
        assert r.hit_tokens <= opt.hit_tokens, (policy, r.hit_tokens, opt.hit_tokens)
    if opt.skipped == 0:  # the ceiling counts every request
        assert opt.hit_rate <= ceiling + 1e-12


def test_optimum_lets_blocks_be_recomputed_by_requests_that_cannot_look_them_up():
    # Found by the randomized test above: B = (0, 10) is computed again by every request that
    # is exactly one block long (lookup range 0) before r10 looks it up, so keeping it through
    # r6 is worth nothing, while A = (2, 12) is only ever computed once: keep A.
    b = (0, 10)
    trace = [
        tok(0, (2, 12)),
        tok(0, (2, 12, 20)),
        tok(0, b),
        tok(0, b),
        tok(0, b),
        tok(0, b),
        tok(0, (1, 11, 20)),
        tok(0, b),
        tok(0, b),
        tok(0, b),
        tok(0, (0, 10, 20)),
        tok(0, (2, 12, 20)),
    ]
    tm = TimeModel(0.0, 10.0, False)
    assert replay(trace, 3, 2, "lfu", tm).hit_tokens == 6
    assert replay_optimum(trace, 3, 2, tm).hit_tokens == 6


def test_optimum_keeps_duplicate_copies_of_a_held_block():
    # r1..r3 run together, each with its own copy of B; r4 evicts the copy r1 freed, and the
    # copies r2 and r3 free afterwards still carry B to r5 (as in the manager).
    trace = [
        tok(0, (0, 10, 0, 10, 20), 1),
        tok(0, (0, 10)),
        tok(0, (0, 10)),
        tok(0, (0, 10)),
        tok(0, (1, 11)),
        tok(0, (0, 10, 20)),
    ]
    tm = TimeModel(0.0, 10.0, False)
    assert replay(trace, 3, 2, "lru", tm).hit_tokens == 2
    assert replay_optimum(trace, 3, 2, tm).hit_tokens == 2


def test_reuse_oracle_evicts_blocks_that_never_return_first():
    # r2 must evict one of A (from r0) and C (from r1): LRU drops the older A, the oracle knows
    # C never returns and keeps A, which r3 hits.
    tm = TimeModel(0.0, 10.0, False)
    trace = [tok(0, (0, 10, 20)), tok(SPACED, (5, 15, 20)), tok(2 * SPACED, (7, 17, 20)), tok(3 * SPACED, (0, 10, 21))]
    assert replay(trace, 3, 2, "lru", tm).hit_tokens == 0
    assert replay_optimum(trace, 3, 2, tm, reuse_oracle=True).hit_tokens == 2
    assert replay_optimum(trace, 3, 2, tm).hit_tokens == 2


# -- a CPU tier below the pool (--cpu-tier-blocks) -------------------------------------------------
def test_cpu_tier_serves_what_the_pool_evicted():
    # 3 blocks of 4 tokens: r0 caches 2 blocks, r1 (unrelated) evicts them, r2 repeats r0's prefix
    trace = [tok(0, range(9)), tok(SPACED, range(100, 109)), tok(2 * SPACED, range(9))]
    r = replay(trace, num_blocks=3, block_size=4)
    assert (r.hit_tokens, r.tier_hit_tokens) == (0, 0)
    t = replay(trace, num_blocks=3, block_size=4, cpu_tier_blocks=8)
    assert (t.hit_tokens, t.tier_hit_tokens, t.evictions) == (0, 8, r.evictions)  # r2's 2 blocks from the tier
    # a 1-block tier keeps the last evicted: r0 freed its tail first, so its root block went last
    small = replay(trace, num_blocks=3, block_size=4, cpu_tier_blocks=1)
    assert small.tier_hit_tokens == 4
    assert t.total_hit_rate == 8 / 27 and t.as_dict()["total_hit_rate"] == t.total_hit_rate


def test_unbounded_cpu_tier_reaches_the_infinite_cache_ceiling():
    from prefixkv.replay import load_mooncake

    trace = load_mooncake("examples/traces/conversation_sample.jsonl", 200)
    ceiling = infinite_cache_hit_rate(trace, 512)
    pool = replay(trace, num_blocks=600, block_size=512)
    tiered = replay(trace, num_blocks=600, block_size=512, cpu_tier_blocks=10**7)
    assert pool.total_hit_rate < ceiling - 0.01 and pool.evictions > 0
    assert abs(tiered.total_hit_rate - ceiling) < 1e-12
    assert tiered.hit_tokens == pool.hit_tokens  # the tier changes nothing in the pool itself


def test_pin_top_keeps_the_system_prompt_a_flood_would_evict():
    from prefixkv.replay.pins import hot_prefixes

    bs = 4
    system = tuple(range(1, 9))  # two blocks every "chat" request opens with
    trace = []
    for t in range(40):
        if t % 5 == 0:
            trace.append(TraceRequest(t * 1e6, 10, 1, token_ids=(*system, 500 + t, 600 + t)))
        else:  # a unique prompt that fills most of the pool
            trace.append(TraceRequest(t * 1e6, 22, 1, token_ids=tuple(range(1000 * t, 1000 * t + 22))))
    assert hot_prefixes(trace, bs, 3) == [system]
    plain = replay(trace, num_blocks=10, block_size=bs)
    pinned = replay(trace, num_blocks=10, block_size=bs, pin_top=1)
    assert plain.hit_tokens == 0  # every flood evicts the system prompt
    assert pinned.hit_tokens == 7 * len(system) and pinned.pinned_blocks == 2 and pinned.pins_refused == 0
    refused = replay(trace, num_blocks=10, block_size=bs, pin_top=1, max_pinned_fraction=0.1)
    assert refused.pins_refused == 1 and refused.hit_tokens == 0


def test_a_copy_still_held_carries_the_identity_in_the_optimum():
    """Found by the property above: r4 and r5 each recompute block [0, 10] (their lookup range is
    empty); when r4 ends, r5's copy - still held - carries the identity, so r7 hits it. The optimum
    had freed r4's copy as the cached one and evicted it for r6, and LRU (which hits r5's copy)
    beat it: 2 hit tokens against 0."""
    tm = TimeModel(0.0, 10.0, False)
    trace = [tok(0, (0, 10, 0, 10, 0, 10), out=1)] + [tok(0, (0, 10))] * 4
    trace += [tok(0, (0, 10), out=1), tok(0, (1, 11, 20)), tok(0, (0, 10, 20))]
    assert replay(trace, 3, 2, "lru", tm).hit_tokens == 2
    assert replay_optimum(trace, 3, 2, tm).hit_tokens == 2
