"""Pinned prefixes through the offline API: a system prompt kept cached under a flood, per tenant,
bounded, released; caching's outputs unchanged; residency metrics moving."""

from __future__ import annotations

import pytest

from prefixkv import LLM, SamplingParams
from prefixkv.cache import PinError
from prefixkv.config import EngineConfig
from prefixkv.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=4)
SYSTEM = [{"role": "system", "content": "You are a terse assistant for the Acme support desk. " * 6}]  # 84 tokens
# The cache a flood runs through: small, so that three short prompts take more blocks than it holds,
# while each fits beside a 5-block pin or a 6-block prefix kept by priority.
FLOOD_BLOCKS = 12
FLOOD = SamplingParams(temperature=0, max_tokens=1)


def make_llm(default_lm, num_blocks=40, **kw):
    config = EngineConfig(
        dtype="float32", device="cpu", num_blocks=num_blocks, block_size=16, max_model_len=num_blocks * 16, **kw
    )
    return LLM.from_engine(LLMEngine(config, loaded=default_lm))


def flood(llm, first=0, priority=None):
    """Three unique prompts (74 tokens and one generated: 5 blocks each), none cached before,
    that together take more blocks than the cache holds: every unpinned block is evicted in turn."""
    taken = 0
    for i in range(first, first + 3):
        prompt = f"Story {i}: " + " ".join(f"w{i}x{j}" for j in range(16))
        out = llm.generate(prompt, FLOOD, priority=None if priority is None else [priority], use_tqdm=False)[0]
        assert out.num_cached_tokens == 0
        taken += -(-(len(out.prompt_token_ids) + 1) // 16)
    assert taken > llm.llm_engine.num_blocks


def free_again(llm):
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    return engine.kv_cache_manager.num_free_blocks + engine.kv_cache_manager.pins.num_pinned_blocks == engine.num_blocks


def test_a_pinned_system_prompt_survives_a_flood_and_outputs_do_not_change(default_lm):
    llm = make_llm(default_lm, FLOOD_BLOCKS, kv_cache_metrics=True, kv_cache_metrics_sample=1.0)
    pinned = llm.pin_prefix(SYSTEM)
    assert pinned >= 64 and pinned % 16 == 0
    flood(llm)
    conversation = [*SYSTEM, {"role": "user", "content": "Where is my order?"}]
    out = llm.chat(conversation, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens >= pinned  # the system prompt came from the cache
    plain = make_llm(default_lm, FLOOD_BLOCKS, enable_prefix_caching=False)
    assert out.outputs[0].token_ids == plain.chat(conversation, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    metrics = llm.llm_engine.scheduler.kv_cache_manager.residency
    assert metrics is not None and metrics.evictions["capacity"] > 0
    assert metrics.take().lifetime_s  # the flood's blocks were evicted and measured
    assert free_again(llm)
    assert llm.unpin_prefix(SYSTEM) == pinned
    assert llm.llm_engine.kv_cache_manager.num_free_blocks == llm.llm_engine.num_blocks
    flood(llm, first=3)
    again = llm.chat(conversation, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0  # unpinned: the flood evicted it


def test_pins_are_per_tenant_bounded_and_kept_by_reset_only_when_asked(default_lm):
    llm = make_llm(default_lm, max_pinned_fraction=0.25)  # 10 blocks
    ids = llm.get_tokenizer().encode("Tenant A's long shared instructions. " * 12)
    assert llm.pin_prefix(ids, cache_salt="tenant-a") > 0
    assert llm.unpin_prefix(ids, cache_salt="tenant-b") == 0  # another tenant reaches nothing
    assert llm.unpin_prefix(ids) == 0
    assert llm.llm_engine.kv_cache_manager.pins.num_pinned_blocks > 0
    too_long = llm.get_tokenizer().encode("Another very long document. " * 40)
    with pytest.raises(PinError, match="max-pinned-fraction"):
        llm.pin_prefix(too_long)
    assert llm.reset_prefix_cache(keep_pinned=True)
    assert llm.llm_engine.kv_cache_manager.pins.num_pinned_blocks > 0
    out = llm.generate({"prompt_token_ids": [*ids, 13]}, GREEDY, use_tqdm=False, cache_salt="tenant-a")[0]
    assert out.num_cached_tokens > 0
    assert llm.reset_prefix_cache()
    assert llm.llm_engine.kv_cache_manager.num_free_blocks == llm.llm_engine.num_blocks
    with pytest.raises(ValueError, match="pin_prefix takes"):
        llm.pin_prefix([])
    with pytest.raises(ValueError, match="max_pinned_fraction"):
        EngineConfig(max_pinned_fraction=2.0)


def test_a_residency_sample_without_the_metrics_is_refused():
    with pytest.raises(ValueError, match="needs kv_cache_metrics"):
        EngineConfig(kv_cache_metrics_sample=0.5)
    assert EngineConfig(kv_cache_metrics=True, kv_cache_metrics_sample=0.5).kv_cache_metrics_sample == 0.5


@pytest.mark.parametrize("policy", ["priority", "lru"])
def test_request_priority_orders_retention_without_priority_scheduling(default_lm, policy):
    """vLLM's `priority` with the priority eviction policy (first come first served scheduling):
    an important request's prefix outlives a flood of less important ones; under LRU it does not."""
    llm = make_llm(default_lm, FLOOD_BLOCKS, eviction_policy=policy)
    document = "Reference manual, chapter one: " + " ".join(f"clause{j}" for j in range(30))
    first = llm.generate(document, GREEDY, priority=[-5] if policy == "priority" else None, use_tqdm=False)[0]
    flood(llm, priority=10 if policy == "priority" else None)
    again = llm.generate(document, GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    whole_blocks = (len(first.prompt_token_ids) - 1) // 16 * 16  # a prompt's last token is always computed
    assert whole_blocks >= 80
    if policy == "priority":
        assert again.num_cached_tokens == whole_blocks  # its whole blocks, kept through the flood
    else:
        assert again.num_cached_tokens == 0
    assert free_again(llm)
