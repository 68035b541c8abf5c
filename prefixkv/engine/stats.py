"""EngineStats: a frozen snapshot of the engine's gauges and counters.

The engine replaces its snapshot (one attribute assignment, atomic in CPython) after every step,
add, abort and reset, so another thread - the server's /metrics - reads a consistent view
without touching the scheduler's lists while the engine thread changes them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int = 0  # requests (sequences) in the running set
    num_waiting: int = 0  # waiting or preempted
    num_waiting_capacity: int = 0  # of those, waiting for room (blocks, budget, the running cap)
    num_waiting_deferred: int = 0  # of those, waiting for a KV tier load
    kv_cache_usage: float = 0.0  # fraction of blocks held by requests
    prefix_cache_requests: int = 0  # admissions looked up in the prefix cache
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    # preempted requests admitted again, re-reading their own blocks: kept apart from the above
    prefix_cache_preempted_queries: int = 0
    prefix_cache_preempted_hits: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    num_requests_errored: int = 0  # finished with an error (RequestOutput.error set)
    num_kv_events_dropped: int = 0
    num_blocks: int = 0
    block_size: int = 0
    # pinned prefixes (cache/pins.py) and, with kv_cache_metrics, evictions by cause (cache/residency.py)
    num_pinned_prefixes: int = 0
    num_pinned_blocks: int = 0
    kv_block_evictions: tuple[tuple[str, int], ...] = ()
    max_model_len: int = 0
    # CPU threads (cpu_thread_policy adaptive, engine/cpu_threads.py): the last step's count (0: the
    # policy is off), other processes' load on our cores in cores, steps run on another count than
    # configured, long steps that timed their layers on two counts, long steps that split their
    # products by rows (model/row_split.py)
    cpu_threads: int = 0
    cpu_foreign_load: float = 0.0
    cpu_steps_adapted: int = 0
    cpu_steps_probed: int = 0
    cpu_steps_row_split: int = 0
    # async_scheduling: steps scheduled and launched before the previous step's tokens were read
    num_steps_ahead: int = 0
    # speculative decoding (speculative_config): drafts verified, their tokens, those kept, and
    # those kept per draft position (empty: off)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_position: tuple[int, ...] = ()
    # LoRA (enable_lora): names of the adapters of running / waiting requests, and max_loras (0: off)
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_loras: int = 0
    # KV tiers (prefixkv/tiers): tokens of admissions that consulted them / tokens loaded from
    # them (vLLM's external prefix cache), and each tier's counters (tiers.TierStats)
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_tiers: tuple[Any, ...] = ()
    # vision-language models: the encoder cache (prefixkv/multimodal/encoder_cache.py)
    multimodal: bool = False
    mm_encoder_cache_queries: int = 0  # items looked up, once per item per step that needs it
    mm_encoder_cache_hits: int = 0
    mm_encoder_runs: int = 0  # images encoded
    mm_encoder_cache_bytes: int = 0
    mm_encoder_cache_budget_bytes: int = 0

    @property
    def mm_encoder_cache_hit_rate(self) -> float:
        q = self.mm_encoder_cache_queries
        return self.mm_encoder_cache_hits / q if q else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
