"""Prefix-cache counters count prefix reuse only: a preempted request admitted again re-reads its
own blocks, and vLLM keeps those lookups apart (PrefixCacheStats' preempted fields). Eight prompts
sharing nothing, a KV cache small enough to preempt: zero hits, as every request's
num_cached_tokens says; the re-reads are counted on their own."""

from __future__ import annotations

from prefixkv import LLM, SamplingParams
from prefixkv.config import EngineConfig
from prefixkv.engine.llm_engine import LLMEngine


def test_preempted_requests_rereading_their_blocks_are_not_prefix_hits(default_lm):
    config = EngineConfig(dtype="float32", device="cpu", num_blocks=14, block_size=16, max_model_len=128)
    llm = LLM.from_engine(LLMEngine(config, loaded=default_lm))
    prompts = [f"Topic {i}: " + " ".join(f"t{i}w{j}" for j in range(12)) for i in range(8)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0  # the scenario needs preemptions
    assert all(o.num_cached_tokens == 0 for o in outs)
    assert stats.prefix_cache_hits == sum(o.num_cached_tokens for o in outs) == 0
    assert stats.prefix_cache_requests == 8  # each request's first admission
    assert stats.prefix_cache_queries == sum(len(o.prompt_token_ids) for o in outs)
    assert stats.prefix_cache_preempted_queries > 0 and stats.prefix_cache_preempted_hits > 0
    assert llm.llm_engine.kv_cache_manager.num_free_blocks == llm.llm_engine.num_blocks
