"""Prometheus metrics under vLLM's names, so existing vLLM dashboards work unchanged.

Counters and gauges that mirror engine state are read from the engine on each scrape (a custom
collector), so they always agree with the engine's own statistics; latency histograms are
observed by the engine thread when a request finishes. Each app gets its own CollectorRegistry.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..outputs import RequestOutput
from .tier_metrics import tier_metric_families

if TYPE_CHECKING:
    from ..engine.llm_engine import LLMEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets
TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
TPOT_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
LATENCY_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000]
# block residency (--kv-cache-metrics): seconds from a blink to an hour, and blocks allocated in between
RESIDENCY_BUCKETS = [0.001, 0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600]
REUSE_DISTANCE_BUCKETS = [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144]


def buckets_1_2_5(largest: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `largest` (vLLM's build_1_2_5_buckets)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > largest:
                return out
            out.append(float(m * scale))
        scale *= 10


def iteration_buckets(max_num_batched_tokens: int) -> list[float]:
    """Powers of two up to the step's token budget (vLLM's are its CUDA graph sizes + the budget)."""
    out, b = [], 1
    while b < max_num_batched_tokens:
        out.append(float(b))
        b *= 2
    return [*out, float(max_num_batched_tokens)]


class _EngineCollector:
    def __init__(self, engine: LLMEngine, labels: dict[str, str], per_item: bool = True) -> None:
        self.engine = engine
        self.labels = labels
        self.per_item = per_item  # ServerMetrics' `per_item_signals`

    def describe(self):
        return []

    def collect(self):
        e = self.engine
        names, values = list(self.labels), list(self.labels.values())

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, float(value))
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, float(value))
            return c

        # one snapshot, published by the engine thread: never the scheduler's live lists
        stats = e.get_stats()
        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", stats.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting)
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of requests waiting, by reason: capacity (KV blocks, token budget) or deferred (a KV tier load).",
            labels=[*self.labels, "reason"],
        )
        by_reason.add_metric([*self.labels.values(), "capacity"], stats.num_waiting_capacity)
        by_reason.add_metric([*self.labels.values(), "deferred"], stats.num_waiting_deferred)
        yield by_reason
        if stats.max_loras:  # vLLM's info gauge: the labels carry the adapters, the value a timestamp
            info = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            )
            info.add_metric(
                [
                    str(stats.max_loras),
                    ",".join(stats.running_lora_adapters),
                    ",".join(stats.waiting_lora_adapters),
                ],
                time.time(),
            )
            yield info
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats.kv_cache_usage)
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            stats.prefix_cache_queries,
        )
        yield counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", stats.prefix_cache_hits
        )
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.num_prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", stats.num_generation_tokens)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", stats.num_preemptions)
        yield gauge(
            "prefixkv:prefix_cache_hit_rate",
            "Cumulative prefix cache hit rate (hit tokens / queried tokens).",
            stats.prefix_cache_hit_rate,
        )
        yield counter(
            "prefixkv:prefix_cache_requests", "Requests looked up in the prefix cache.", stats.prefix_cache_requests
        )
        yield counter(
            "prefixkv:prefix_cache_preempted_queries",
            "Tokens looked up by preempted requests admitted again (not in vllm:prefix_cache_queries).",
            stats.prefix_cache_preempted_queries,
        )
        yield counter(
            "prefixkv:prefix_cache_preempted_hits",
            "Of those, tokens found: a preempted request re-reading its own blocks (not in vllm:prefix_cache_hits).",
            stats.prefix_cache_preempted_hits,
        )
        yield gauge("prefixkv:pinned_prefixes", "Prefixes pinned in the KV cache.", stats.num_pinned_prefixes)
        yield gauge("prefixkv:pinned_blocks", "KV blocks held by pinned prefixes.", stats.num_pinned_blocks)
        if stats.kv_block_evictions:  # --kv-cache-metrics
            evictions = CounterMetricFamily(
                "prefixkv:kv_block_evictions",
                "Cached KV blocks that lost their identity, by cause: capacity (reused for new content), "
                "unreachable (an unloaded adapter's), reset (reset_prefix_cache).",
                labels=[*names, "cause"],
            )
            for cause, n in stats.kv_block_evictions:
                evictions.add_metric([*values, cause], float(n))
            yield evictions
        yield counter(
            "prefixkv:requests_errored",
            "Requests the engine failed on their own (the rest went on).",
            stats.num_requests_errored,
        )
        yield counter(
            "prefixkv:kv_events_dropped",
            "KV cache events dropped because nobody drained them.",
            stats.num_kv_events_dropped,
        )
        if stats.cpu_threads:  # --cpu-thread-policy adaptive on a CPU engine (engine/cpu_threads.py)
            threads_doc = "Threads the last CPU step ran on."
            load_doc = "CPU other processes used on this engine's cores over the last window, in cores."
            adapted_doc = "Steps run on another thread count than the configured one (CPU contention)."
            yield gauge("prefixkv:cpu_threads", threads_doc, stats.cpu_threads)
            yield gauge("prefixkv:cpu_foreign_load", load_doc, stats.cpu_foreign_load)
            yield counter("prefixkv:cpu_steps_adapted", adapted_doc, stats.cpu_steps_adapted)
            probed_doc = "Long steps beside a neighbour that timed their first layers on two thread counts."
            yield counter("prefixkv:cpu_steps_probed", probed_doc, stats.cpu_steps_probed)
            split_doc = "Long steps beside a neighbour whose products handed their rows to threads as they came free."
            yield counter("prefixkv:cpu_steps_row_split", split_doc, stats.cpu_steps_row_split)
        if stats.spec_decode_accepted_per_position:  # speculative_config (prefixkv/speculative)
            drafts_doc = "Number of spec decoding drafts."
            yield counter("vllm:spec_decode_num_drafts", drafts_doc, stats.spec_decode_num_drafts)
            draft_doc = "Number of draft tokens."
            yield counter("vllm:spec_decode_num_draft_tokens", draft_doc, stats.spec_decode_num_draft_tokens)
            accepted_doc = "Number of accepted tokens."
            yield counter("vllm:spec_decode_num_accepted_tokens", accepted_doc, stats.spec_decode_num_accepted_tokens)
            per_pos = CounterMetricFamily(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                labels=[*names, "position"],
            )
            for pos, n in enumerate(stats.spec_decode_accepted_per_position):
                per_pos.add_metric([*values, str(pos)], n)
            yield per_pos
        if e.async_scheduling:
            ahead_doc = "Steps scheduled and launched before the previous step's tokens were read (--async-scheduling)."
            yield counter("prefixkv:steps_scheduled_ahead", ahead_doc, stats.num_steps_ahead)
        cfg = e.config
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[
                "block_size",
                "cache_dtype",
                "enable_prefix_caching",
                "num_gpu_blocks",
                "prefix_caching_hash_algo",
                "kv_cache_memory_bytes",
                "eviction_policy",
            ],
        )
        algo = cfg.prefix_caching_hash_algo
        info.add_metric(
            [
                str(stats.block_size),
                str(getattr(cfg, "kv_cache_dtype", "auto")),
                str(bool(cfg.enable_prefix_caching)),
                str(stats.num_blocks),
                algo if isinstance(algo, str) else "custom",
                str(cfg.kv_cache_memory_bytes),
                str(getattr(cfg, "eviction_policy", "lru")),
            ],
            1.0,
        )
        yield info
        if stats.multimodal and self.per_item:  # the image encoder cache (docs/multimodal.md)
            yield counter(
                "prefixkv:mm_encoder_cache_queries",
                "Images looked up in the encoder cache (once per image per step that needs it).",
                stats.mm_encoder_cache_queries,
            )
            yield counter(
                "prefixkv:mm_encoder_cache_hits",
                "Encoder cache lookups that found the image.",
                stats.mm_encoder_cache_hits,
            )
            yield counter("prefixkv:mm_encoder_runs", "Images run through the vision encoder.", stats.mm_encoder_runs)
            # vLLM's multimodal cache families (its dashboard's), the same counts
            queries, hits = stats.mm_encoder_cache_queries, stats.mm_encoder_cache_hits
            yield counter("vllm:mm_cache_queries", "Multimodal cache queries, in items.", queries)
            yield counter("vllm:mm_cache_hits", "Multimodal cache hits, in items.", hits)
            yield gauge(
                "prefixkv:mm_encoder_cache_usage_bytes",
                "Bytes held by the encoder cache.",
                stats.mm_encoder_cache_bytes,
            )
        yield gauge("prefixkv:num_kv_blocks", "KV cache blocks in the pool.", stats.num_blocks)
        yield gauge("prefixkv:block_size", "Tokens per KV cache block.", stats.block_size)
        yield gauge("prefixkv:max_model_len", "Longest sequence (prompt + output) accepted.", stats.max_model_len)
        yield from tier_metric_families(stats, names, values)


class ServerMetrics:
    def __init__(self, engine: LLMEngine, model_name: str, per_item_signals: bool = True) -> None:
        """`per_item_signals` False leaves out the counters that move when one particular item is
        seen again (the image encoder cache's queries, hits, runs and bytes): a multi-tenant server
        (--require-cache-salt) whose /metrics is open to every client (no --api-key)."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = {"model_name": model_name, "engine": "0"}
        self.registry.register(_EngineCollector(engine, self.labels, per_item_signals))
        names = list(self.labels)
        r = self.registry

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(**self.labels)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", LATENCY_BUCKETS
        )
        # vLLM 0.32: the per-request mean is request_time_per_output_token; the old name stays an alias
        self.tpot = histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds (alias of vllm:request_time_per_output_token_seconds).",
            TPOT_BUCKETS,
        )
        self.request_tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            TPOT_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", TPOT_BUCKETS
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", LATENCY_BUCKETS
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            LATENCY_BUCKETS,
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            iteration_buckets(engine.config.max_num_batched_tokens),
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            LATENCY_BUCKETS,
        )
        self.prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", TOKEN_BUCKETS
        )
        self.gen_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", TOKEN_BUCKETS
        )
        length_buckets = buckets_1_2_5(engine.max_model_len)
        self.max_gen_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            length_buckets,
        )
        self.params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", [1, 2, 5, 10, 20])
        self.params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", length_buckets
        )
        self.prompt_tokens_cached = Counter(
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local prefix cache and KV tiers).",
            names,
            registry=r,
        ).labels(**self.labels)
        # --kv-cache-metrics: vLLM's sampled block residency histograms, and the reuse distance
        self.residency = engine.scheduler.kv_cache_manager.residency
        if self.residency is not None:
            self.block_lifetime = histogram(
                "vllm:kv_block_lifetime_seconds",
                "Histogram of KV cache block lifetime from allocation to eviction. Sampled metrics.",
                RESIDENCY_BUCKETS,
            )
            self.block_idle = histogram(
                "vllm:kv_block_idle_before_evict_seconds",
                "Histogram of idle time before KV cache block eviction. Sampled metrics.",
                RESIDENCY_BUCKETS,
            )
            self.block_reuse_gap = histogram(
                "vllm:kv_block_reuse_gap_seconds",
                "Histogram of time between consecutive accesses to the same KV cache block. Sampled metrics.",
                RESIDENCY_BUCKETS,
            )
            self.block_reuse_distance = histogram(
                "prefixkv:kv_block_reuse_distance_blocks",
                "Histogram of KV blocks allocated between consecutive accesses to the same block (a cache of "
                "more blocks than this would have kept it). Sampled metrics.",
                REUSE_DISTANCE_BUCKETS,
            )
        self.success = Counter(
            "vllm:request_success", "Count of successfully processed requests.", names + ["finished_reason"], registry=r
        )
        self.aborted = Counter(
            "prefixkv:request_aborted", "Requests aborted (client gone or cancelled).", names, registry=r
        ).labels(**self.labels)
        self.http_errors = Counter(
            "prefixkv:http_request_errors", "Requests answered with an error status.", names + ["status"], registry=r
        )

    def on_step(self, num_tokens: int, inter_token_latencies: list[float]) -> None:
        """Called on the engine thread after every step: tokens per step, and one inter-token
        latency per sequence that got a token after an earlier one (the engine's bookings, as vLLM
        counts them: whatever the request's output kind, streamed or not)."""
        if num_tokens > 0:
            self.iteration_tokens.observe(num_tokens)
        if self.residency is not None:
            seen = self.residency.take()
            for value in seen.lifetime_s:
                self.block_lifetime.observe(value)
            for value in seen.idle_before_evict_s:
                self.block_idle.observe(value)
            for value in seen.reuse_gap_s:
                self.block_reuse_gap.observe(value)
            for blocks in seen.reuse_distance_blocks:
                self.block_reuse_distance.observe(blocks)
        for seconds in inter_token_latencies:
            self.itl.observe(seconds)

    def on_finished(self, out: RequestOutput) -> None:
        """Called on the engine thread when a request finishes."""
        m = out.metrics
        n_out = sum(len(o.token_ids) for o in out.outputs)
        if m is not None:
            if m.first_token_time is not None:
                self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
                if m.first_scheduled_time is not None:
                    self.prefill_time.observe(max(0.0, m.first_token_time - m.first_scheduled_time))
                if m.last_token_time is not None:
                    decode = max(0.0, m.last_token_time - m.first_token_time)
                    self.decode_time.observe(decode)
                    per_seq = n_out // max(1, len(out.outputs))
                    if per_seq > 1:
                        self.request_tpot.observe(decode / (per_seq - 1))
                    if m.first_scheduled_time is not None:
                        self.inference_time.observe(max(0.0, m.last_token_time - m.first_scheduled_time))
            if m.finished_time is not None:
                self.e2e.observe(max(0.0, m.finished_time - m.arrival_time))
                if m.first_token_time is not None and n_out > len(out.outputs):
                    self.tpot.observe(
                        max(0.0, (m.finished_time - m.first_token_time) / max(1, n_out // len(out.outputs) - 1))
                    )
            if m.first_scheduled_time is not None:
                self.queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        self.prompt_tokens.observe(len(out.prompt_token_ids))
        self.gen_tokens.observe(n_out)
        self.max_gen_tokens.observe(max((len(o.token_ids) for o in out.outputs), default=0))
        self.params_n.observe(len(out.outputs))
        if m is not None and m.max_tokens is not None:
            self.params_max_tokens.observe(m.max_tokens)
        self.prompt_tokens_cached.inc(out.num_cached_tokens)
        for o in out.outputs:
            self.success.labels(finished_reason=o.finish_reason or "abort", **self.labels).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
