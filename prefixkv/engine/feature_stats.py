"""The stats snapshot's per-feature fields: each feature that is off adds none."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..cache import KVCacheManager
from ..request import Request
from .builder import EngineParts

if TYPE_CHECKING:
    from ..lora.manager import LoRAManager
    from ..multimodal import EncoderCache
    from ..tiers import TierManager
    from .cpu_threads import AdaptiveCpuThreads
    from .scheduler import Scheduler


def feature_stats(parts: EngineParts) -> dict[str, Any]:
    """EngineStats' fields of the CPU thread policy, LoRA, the KV tiers, multimodal inputs, and
    the cache's pins and residency metrics."""
    return {
        **waiting_stats(parts.scheduler),
        **cache_control_stats(parts.scheduler.kv_cache_manager),
        **cpu_thread_stats(parts.cpu_threads),
        **lora_stats(parts.lora_manager, parts.scheduler),
        **tier_stats(parts.tiers),
        **mm_stats(parts.encoder_cache),
        **spec_decode_stats(parts.scheduler),
    }


def spec_decode_stats(scheduler: Scheduler) -> dict[str, Any]:
    """Speculative decoding's counters (none when it is off)."""
    if scheduler.drafter is None:
        return {}
    s = scheduler.spec_stats
    return {
        "spec_decode_num_drafts": s.num_drafts,
        "spec_decode_num_draft_tokens": s.num_draft_tokens,
        "spec_decode_num_accepted_tokens": s.num_accepted_tokens,
        "spec_decode_accepted_per_position": tuple(s.accepted_per_position),
    }


def waiting_stats(scheduler: Scheduler) -> dict[str, Any]:
    """Why requests wait, as vLLM's vllm:num_requests_waiting_by_reason says it: for room (KV
    blocks, the token budget, the running cap) or deferred (a KV tier load in flight)."""
    deferred = scheduler.num_loading
    return dict(num_waiting_capacity=len(scheduler.waiting) - deferred, num_waiting_deferred=deferred)


def cache_control_stats(manager: KVCacheManager) -> dict[str, Any]:
    residency = manager.residency
    cache = manager.stats
    return dict(
        prefix_cache_preempted_queries=cache.preempted_queries,
        prefix_cache_preempted_hits=cache.preempted_hits,
        num_pinned_prefixes=len(manager.pins),
        num_pinned_blocks=manager.pins.num_pinned_blocks,
        kv_block_evictions=tuple(residency.evictions.items()) if residency is not None else (),
    )


def cpu_thread_stats(t: AdaptiveCpuThreads | None) -> dict[str, Any]:
    if t is None:
        return {}
    return dict(
        cpu_threads=t.threads,
        cpu_foreign_load=t.load.cores,
        cpu_steps_adapted=t.steps_adapted,
        cpu_steps_probed=t.steps_probed,
        cpu_steps_row_split=t.steps_row_split,
    )


def tier_stats(t: TierManager | None) -> dict[str, Any]:
    if t is None:
        return {}
    return dict(
        external_prefix_cache_queries=t.external_queries,
        external_prefix_cache_hits=t.external_hits,
    )


def mm_stats(c: EncoderCache | None) -> dict[str, Any]:
    if c is None:
        return {}
    return dict(
        multimodal=True,
        mm_encoder_cache_queries=c.queries,
        mm_encoder_cache_hits=c.hits,
        mm_encoder_runs=c.encoder_runs,
        mm_encoder_cache_bytes=c.bytes_used,
        mm_encoder_cache_budget_bytes=c.budget_bytes,
    )


def lora_stats(manager: LoRAManager | None, s: Scheduler) -> dict[str, Any]:
    if manager is None:
        return {}

    def names(reqs: Iterable[Request]) -> tuple[str, ...]:
        return tuple(sorted({r.lora_request.lora_name for r in reqs if r.lora_request is not None}))

    return dict(
        running_lora_adapters=names(s.running),
        waiting_lora_adapters=names(s.waiting),
        max_loras=manager.max_loras,
    )
