"""Each mixture-of-experts family (Mixtral, Qwen2-MoE, Qwen3-MoE) as a tiny random checkpoint
through the whole engine: several prompts in one batch (their tokens routed to different experts),
greedy tokens equal to transformers' with caching off, with shared prefixes cached, with chunked
prefill and under preemption, and every KV block free afterwards."""

from __future__ import annotations

import pytest

from ..model.test_model_moe import KINDS, make_moe
from .engine_oracle import (
    assert_disk_tier_and_stage_outputs,
    assert_engine_matches_transformers,
    assert_same_logprobs,
)

MAX_NEW = 8


@pytest.mark.parametrize("kind", KINDS)
def test_moe_engine_matches_transformers(tmp_path, kind):
    assert_engine_matches_transformers(tmp_path, make_moe(kind), kind, MAX_NEW)


def test_moe_with_a_disk_tier_and_the_stage_output_cache(tmp_path):
    """K/V is per attention layer whatever the MLP: a new engine is served Qwen2-MoE's blocks from a
    disk tier (same tokens), and pooled embeddings from the stage-output cache equal transformers'
    final hidden states."""
    assert_disk_tier_and_stage_outputs(tmp_path, make_moe("qwen2_moe"), 8, MAX_NEW)


def test_device_routing_equals_the_per_expert_products():
    """Experts.grouped (a device's routing: no host read, the counts as offsets of one grouped
    product) against the per-expert loop, float32, tokens spread over every expert and none."""
    import torch

    from prefixkv.model.moe import Experts

    torch.manual_seed(3)
    experts = Experts(8, 64, 32)
    with torch.no_grad():
        experts.gate_up_proj.normal_(std=0.1)
        experts.down_proj.normal_(std=0.1)
    assert experts.grouped_works()
    x = torch.randn(13, 64)
    index = torch.stack([torch.randperm(7)[:2] for _ in range(13)])  # expert 7 gets no token
    weight = torch.rand(13, 2)
    with torch.inference_mode():
        torch.testing.assert_close(experts.grouped(x, index, weight), experts(x, index, weight), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_moe_decode_steps_replay_over_fixed_buffers(tmp_path, monkeypatch, kind):
    """Routed experts through the decode graphs' fixed buffers (the device's routing, run on CPU
    tensors under Triton's interpreter; captured on a GPU): greedy float32 tokens equal
    transformers', each token's logprob the eager steps', every block free after. On a GPU whose
    torch._grouped_mm takes bfloat16 only, in bfloat16 against the eager steps alone."""
    import torch

    from prefixkv import LLM, SamplingParams
    from prefixkv.model import moe

    from ..conftest import hf_greedy
    from ..model.test_model_hf_folder import _write_tokenizer
    from ..model.triton_interpreter import device, kernels_module

    kernels_module()
    monkeypatch.setenv("PREFIXKV_CUDA_GRAPHS", "static" if device().type == "cpu" else "capture")
    monkeypatch.setattr(moe, "GROUPED_ON_CPU", True)
    hf = make_moe(kind)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    dtype = torch.float32
    if device().type == "cuda":
        probe = moe.Experts(8, 64, 32).to(device())
        with torch.no_grad():
            probe.gate_up_proj.normal_()
            probe.down_proj.normal_()
        if not probe.grouped_works():
            dtype = torch.bfloat16
            if not probe.to(dtype).grouped_works():
                pytest.skip("this torch has no torch._grouped_mm for this GPU")
    prompts = [[3 + (5 * i + j) % 200 for j in range(9 + 4 * i)] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    kwargs = dict(
        dtype=str(dtype).removeprefix("torch."), device=str(device()), num_blocks=32, block_size=8, max_model_len=64,
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4]},
    )  # fmt: skip
    llm = LLM(str(tmp_path), **kwargs)
    outs = llm.generate(prompts, params, use_tqdm=False)
    if dtype == torch.float32:
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    engine = llm.llm_engine
    assert engine.runner.graphs is not None and engine.runner.graphs.replays > 0
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
    monkeypatch.setattr(moe, "GROUPED_ON_CPU", False)  # the eager steps route as a CPU does
    eager = LLM(str(tmp_path), **kwargs, enforce_eager=True).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in eager]
    assert_same_logprobs(outs, eager, 1e-4 if dtype == torch.float32 else 2e-2)
