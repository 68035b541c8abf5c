"""Sampled residency metrics (prefixkv/cache/residency.py) move as blocks live, idle and return."""

import pytest

from prefixkv.cache import KVCacheManager, ResidencyMetrics
from prefixkv.lora import LoRARequest
from prefixkv.request import Request

from .conftest import prefill


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def toks(n, start=1):
    return list(range(start, start + n))


def manager(rate=1.0, blocks=6):
    clock = Clock()
    metrics = ResidencyMetrics(sample_rate=rate, clock=clock, seed=0)
    return KVCacheManager(num_blocks=blocks, block_size=4, residency=metrics), metrics, clock


def test_lifetime_idle_time_and_reuse_gaps_are_observed():
    mgr, metrics, clock = manager()
    a = Request("a", toks(9))
    prefill(mgr, a)  # 3 blocks allocated at t=100 (two full, cached)
    clock.now = 103.0
    mgr.free(a)  # idle from 103
    clock.now = 110.0
    b = Request("b", toks(9))
    prefill(mgr, b)  # hits the two cached blocks: reuse gaps 7 s
    obs = metrics.take()
    assert obs.reuse_gap_s == [7.0, 7.0] and len(obs.reuse_distance_blocks) == 2
    clock.now = 111.0
    mgr.free(b)
    clock.now = 120.0
    flood = Request("flood", toks(24, 500))  # all six blocks: evicts both cached ones
    prefill(mgr, flood)
    obs = metrics.take()
    assert sorted(obs.lifetime_s) == [20.0, 20.0]  # allocated at 100, evicted at 120
    assert sorted(obs.idle_before_evict_s) == [9.0, 9.0]  # last released at 111
    assert metrics.evictions["capacity"] == 2
    assert metrics.take().lifetime_s == []  # drained


def test_reuse_distance_counts_blocks_allocated_in_between():
    mgr, metrics, _ = manager(blocks=10)
    a = Request("a", toks(5))  # block 0 full and cached, block 1 partial
    prefill(mgr, a)
    mgr.free(a)
    other = Request("o", toks(12, 300))  # three blocks allocated in between
    prefill(mgr, other)
    mgr.free(other)
    prefill(mgr, Request("b", toks(5)))
    assert metrics.take().reuse_distance_blocks == [3]


def test_evictions_are_counted_by_cause():
    mgr, metrics, _ = manager(blocks=8)
    lora = LoRARequest("ad", 1, "/nowhere")
    a = Request("a", toks(9), lora_request=lora)
    prefill(mgr, a)
    mgr.free(a)
    assert mgr.evict_where(lambda extra: any(k[0] == "lora" for k in extra)) == (2, 0)
    b = Request("b", toks(9, 50))
    prefill(mgr, b)
    mgr.free(b)
    assert mgr.reset_prefix_cache()
    assert metrics.evictions == {"capacity": 0, "unreachable": 2, "reset": 2}
    assert sorted(metrics.take().lifetime_s) == [0.0] * 4


def test_sampling_follows_a_share_of_the_blocks():
    mgr, metrics, _ = manager(rate=0.25, blocks=2000)
    for i in range(40):
        r = Request(f"r{i}", toks(200, 1000 * i))
        prefill(mgr, r)
        mgr.free(r)
    assert 0.15 < metrics.num_followed / 2000 < 0.35
    with pytest.raises(ValueError, match="kv_cache_metrics_sample"):
        ResidencyMetrics(sample_rate=0)


def test_metrics_off_leave_the_default_touch_path():
    mgr = KVCacheManager(num_blocks=4, block_size=4)
    assert mgr.residency is None and mgr.block_pool.touch == mgr.block_pool._touch
