"""Each mixture-of-experts family (Mixtral, Qwen2-MoE, Qwen3-MoE) as a tiny random checkpoint
through the whole engine: several prompts in one batch (their tokens routed to different experts),
greedy tokens equal to transformers' with caching off, with shared prefixes cached, with chunked
prefill and under preemption, and every KV block free afterwards."""

from __future__ import annotations

import random

import pytest

from prefixkv import LLM, SamplingParams

from ..conftest import hf_greedy
from ..model.test_model_hf_folder import _write_tokenizer
from ..model.test_model_moe import KINDS, make_moe

MAX_NEW = 8


@pytest.mark.parametrize("kind", KINDS)
def test_moe_engine_matches_transformers(tmp_path, kind):
    hf = make_moe(kind)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    rng = random.Random(kind)
    shared = [rng.randrange(256) for _ in range(40)]
    prompts = [shared + [rng.randrange(256) for _ in range(rng.randrange(1, 12))] for _ in range(4)]
    prompts.append([rng.randrange(256) for _ in range(7)])
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    settings = [
        dict(enable_prefix_caching=False),
        dict(enable_prefix_caching=True),
        dict(max_num_batched_tokens=9),
        dict(num_blocks=12, block_size=8, max_model_len=96),
    ]
    for kwargs in settings:
        kwargs = {"dtype": "float32", "device": "cpu", "num_blocks": 64, "block_size": 8, "max_model_len": 96, **kwargs}
        llm = LLM(str(tmp_path), **kwargs)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == expected, kwargs
        engine = llm.llm_engine
        assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
        if kwargs.get("enable_prefix_caching", True):
            assert engine.prefix_cache_stats.hits > 0
        if kwargs["num_blocks"] == 12:
            assert engine.scheduler.num_preemptions > 0
