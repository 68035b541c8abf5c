"""Each mixture-of-experts family (Mixtral, Qwen2-MoE, Qwen3-MoE) as a tiny random checkpoint
through the whole engine: several prompts in one batch (their tokens routed to different experts),
greedy tokens equal to transformers' with caching off, with shared prefixes cached, with chunked
prefill and under preemption, and every KV block free afterwards."""

from __future__ import annotations

import pytest

from ..model.test_model_moe import KINDS, make_moe
from .engine_oracle import assert_engine_matches_transformers

MAX_NEW = 8


@pytest.mark.parametrize("kind", KINDS)
def test_moe_engine_matches_transformers(tmp_path, kind):
    assert_engine_matches_transformers(tmp_path, make_moe(kind), kind, MAX_NEW)


def test_moe_with_a_disk_tier_and_the_stage_output_cache(tmp_path):
    """K/V is per attention layer whatever the MLP: a new engine is served Qwen2-MoE's blocks from a
    disk tier (same tokens), and pooled embeddings from the stage-output cache equal transformers'
    final hidden states."""
    import random

    import torch

    from prefixkv import LLM, SamplingParams

    from ..conftest import hf_greedy
    from ..model.test_model_hf_folder import _write_tokenizer

    hf = make_moe("qwen2_moe")
    model = tmp_path / "model"
    hf.save_pretrained(model, safe_serialization=True)
    _write_tokenizer(model)
    rng = random.Random(5)
    prompt = [rng.randrange(256) for _ in range(40)]
    expected = hf_greedy(hf, prompt, MAX_NEW)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    base = dict(dtype="float32", num_blocks=64, block_size=8, max_model_len=96)
    tier = f"disk:{tmp_path / 'kv'}"
    first = LLM(str(model), **base, kv_tier=tier)
    assert first.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids == expected
    first.llm_engine.tiers.flush()
    second = LLM(str(model), **base, kv_tier=tier)
    out = second.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected and out.num_cached_tokens >= 32

    llm = LLM(str(model), **base, enable_stage_output_cache=True)
    docs = [prompt[:32] + [rng.randrange(256) for _ in range(n)] for n in (3, 9)]
    with torch.no_grad():
        ref = [hf(torch.tensor([d]), output_hidden_states=True).hidden_states[-1][0] for d in docs]
    outs = llm.embed([{"prompt_token_ids": d} for d in docs], pooling="all", normalize=False, use_tqdm=False)
    for o, h in zip(outs, ref):
        torch.testing.assert_close(torch.tensor(o.outputs.embedding), h, atol=1e-4, rtol=1e-4)
    assert outs[1].num_cached_tokens >= 32
    assert llm.llm_engine.kv_cache_manager.num_free_blocks == llm.llm_engine.num_blocks
