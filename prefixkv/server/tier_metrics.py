"""Prometheus families of the KV tiers (prefixkv/tiers), read from the engine's stats snapshot:
vLLM's external prefix cache counters (tokens), and per tier (label `tier`) blocks looked up /
found / refused, bytes and seconds moved each way, saves dropped, store errors, availability."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine.stats import EngineStats

# (metric name, TierStats field, help)
_COUNTERS = (
    ("prefixkv:kv_tier_queries", "queries", "KV tier lookups, in blocks."),
    ("prefixkv:kv_tier_hits", "hits", "KV tier hits loaded into the pool, in blocks."),
    (
        "prefixkv:kv_tier_rejected",
        "rejected",
        "KV tier values refused on load (corrupted, foreign, or no valid MAC under the tier secret), in blocks.",
    ),
    ("prefixkv:kv_tier_loaded_bytes", "bytes_loaded", "Bytes loaded from the KV tier."),
    ("prefixkv:kv_tier_load_seconds", "load_seconds", "Seconds spent reading and checking KV tier values."),
    ("prefixkv:kv_tier_saves", "saves", "Blocks written to the KV tier."),
    ("prefixkv:kv_tier_saved_bytes", "bytes_saved", "Bytes written to the KV tier."),
    ("prefixkv:kv_tier_save_seconds", "save_seconds", "Seconds spent writing to the KV tier."),
    ("prefixkv:kv_tier_saves_dropped", "saves_dropped", "Blocks not written: the writer queue full or the tier down."),
    ("prefixkv:kv_tier_errors", "errors", "Failed KV tier store calls (the engine recomputes instead)."),
)


def tier_metric_families(stats: EngineStats, names: list[str], values: list[str]) -> Iterator[Any]:
    if not stats.kv_tiers:
        return
    for name, value, doc in (
        (
            "vllm:external_prefix_cache_queries",
            stats.external_prefix_cache_queries,
            "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of "
            "queried tokens.",
        ),
        (
            "vllm:external_prefix_cache_hits",
            stats.external_prefix_cache_hits,
            "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of "
            "cached tokens.",
        ),
    ):
        c = CounterMetricFamily(name, doc, labels=names)
        c.add_metric(values, float(value))
        yield c
    labels = [*names, "tier"]
    for name, attr, doc in _COUNTERS:
        c = CounterMetricFamily(name, doc, labels=labels)
        for t in stats.kv_tiers:
            c.add_metric([*values, t.tier], float(getattr(t, attr)))
        yield c
    g = GaugeMetricFamily("prefixkv:kv_tier_available", "1 while the KV tier answers, 0 in an outage.", labels=labels)
    for t in stats.kv_tiers:
        g.add_metric([*values, t.tier], 1.0 if t.available else 0.0)
    yield g
