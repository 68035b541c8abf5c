"""One oracle for a tiny random checkpoint served through the whole engine: greedy tokens equal
transformers' with caching off, with shared prefixes cached (hits > 0), with chunked prefill and
under preemption, and every KV block free afterwards; for a recurrent family (its state restored
on a hit) also a prompt served again from the cache, and the features it refuses by name."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from prefixkv import LLM, SamplingParams

from ..conftest import hf_greedy
from ..model.test_model_hf_folder import _write_tokenizer


def assert_engine_matches_transformers(
    folder: Path, hf: Any, seed: str, max_new: int, preempting_blocks: int = 12
) -> None:
    """Greedy tokens equal transformers' with caching off, on, under chunked prefill, and with
    `preempting_blocks` blocks (few enough that requests are preempted)."""
    hf.save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder)
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(40)]
    prompts = [shared + [rng.randrange(256) for _ in range(rng.randrange(1, 12))] for _ in range(4)]
    prompts.append([rng.randrange(256) for _ in range(7)])
    expected = [hf_greedy(hf, p, max_new) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    settings: list[dict[str, Any]] = [
        dict(enable_prefix_caching=False),
        dict(enable_prefix_caching=True),
        dict(max_num_batched_tokens=9),
        dict(num_blocks=preempting_blocks, block_size=8, max_model_len=96),
    ]
    for kwargs in settings:
        kwargs = {"dtype": "float32", "device": "cpu", "num_blocks": 64, "block_size": 8, "max_model_len": 96, **kwargs}
        engine = serve_and_compare(folder, prompts, params, expected, kwargs).llm_engine
        if kwargs["num_blocks"] == preempting_blocks:
            assert engine.scheduler.num_preemptions > 0


def serve_and_compare(
    folder: Path | str, prompts: list[list[int]], params: SamplingParams, expected: list[list[int]], kwargs: dict
) -> LLM:
    """An LLM on `folder` with `kwargs` generates `expected` for `prompts`, every KV block is free
    after, and with caching on (the default) the shared prefixes hit; the LLM, for more checks."""
    llm = LLM(str(folder), **kwargs)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected, kwargs
    engine = llm.llm_engine
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
    if kwargs.get("enable_prefix_caching", True):
        assert engine.prefix_cache_stats.hits > 0
    return llm


def hf_generate(hf: Any, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy generate (a recurrent model: its chunked scan for the prompt, its
    one-token state update after), exactly n tokens: no EOS ends it and none is suppressed, as the
    engine's ignore_eos goes on past one (min_new_tokens would keep EOS from being drawn)."""
    out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, eos_token_id=[], pad_token_id=257)
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt) :].tolist()


def assert_recurrent_engine_matches_transformers(folder: str, hf: Any, max_new: int) -> None:
    """The oracle above for a saved recurrent or hybrid checkpoint, against transformers' own
    generate; with caching on, a prompt served again restores its state from the cache."""
    rng = random.Random(0)
    shared = [rng.randrange(256) for _ in range(40)]
    prompts = [shared + [rng.randrange(256) for _ in range(rng.randrange(1, 12))] for _ in range(4)]
    prompts.append([rng.randrange(256) for _ in range(7)])
    expected = [hf_generate(hf, p, max_new) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    settings: list[dict[str, Any]] = [
        dict(enable_prefix_caching=False),
        dict(enable_prefix_caching=True),
        dict(max_num_batched_tokens=9),
        dict(num_blocks=12, block_size=8, max_model_len=96),
    ]
    for kwargs in settings:
        kwargs = {"dtype": "float32", "device": "cpu", "num_blocks": 64, "block_size": 8, "max_model_len": 96, **kwargs}
        llm = LLM(folder, **kwargs)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected, kwargs
        engine = llm.llm_engine
        assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
        if kwargs.get("enable_prefix_caching", True):
            assert engine.prefix_cache_stats.hits > 0
            again = llm.generate([prompts[0]], params, use_tqdm=False)[0]
            assert again.num_cached_tokens > 0
            assert again.outputs[0].token_ids == expected[0]
            assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
        if kwargs["num_blocks"] == 12:
            assert engine.scheduler.num_preemptions > 0


# what a recurrent family refuses by name: the tiers move K/V rows, LoRA adapts projections
KV_SHAPED_FEATURES = [
    (dict(kv_offloading_size=0.01), "kv_offloading_size"),
    (dict(enable_lora=True), "enable_lora"),
]


def assert_refused(folder: str, kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        LLM(folder, dtype="float32", device="cpu", num_blocks=16, block_size=8, **kwargs)


def assert_disk_tier_and_stage_outputs(tmp_path: Path, hf: Any, block_size: int, max_new: int) -> None:
    """The per-block features are model-agnostic: a new engine is served the model's blocks from a
    disk tier (same tokens), and pooled embeddings from the stage-output cache equal transformers'
    final hidden states, the second document's over a hit."""
    model = tmp_path / "model"
    hf.save_pretrained(model, safe_serialization=True)
    _write_tokenizer(model)
    rng = random.Random(3)
    prompt = [rng.randrange(256) for _ in range(4 * block_size - 4)]
    expected = hf_greedy(hf, prompt, max_new)
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    base = dict(dtype="float32", num_blocks=64, block_size=block_size, max_model_len=8 * block_size)
    tier = f"disk:{tmp_path / 'kv'}"
    first = LLM(str(model), **base, kv_tier=tier)
    assert first.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids == expected
    first.llm_engine.tiers.flush()
    second = LLM(str(model), **base, kv_tier=tier)
    out = second.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected and out.num_cached_tokens >= 3 * block_size

    llm = LLM(str(model), **base, enable_stage_output_cache=True)
    docs = [prompt[: 2 * block_size + 8] + [rng.randrange(256) for _ in range(n)] for n in (3, 9)]
    with torch.no_grad():
        ref = [hf(torch.tensor([d]), output_hidden_states=True).hidden_states[-1][0] for d in docs]
    outs = llm.embed([{"prompt_token_ids": d} for d in docs], pooling="all", normalize=False, use_tqdm=False)
    for o, h in zip(outs, ref):
        torch.testing.assert_close(torch.tensor(o.outputs.embedding), h, atol=1e-4, rtol=1e-4)
    assert outs[1].num_cached_tokens >= 2 * block_size
    assert llm.llm_engine.kv_cache_manager.num_free_blocks == llm.llm_engine.num_blocks


def assert_prompt_logprobs_over_stage_outputs(folder: str, hf: Any) -> None:
    """Prompt logprobs over a cached prefix (its hidden states from the stage-output cache) equal
    the uncached ones, and the tokens transformers'."""
    rng = random.Random(1)
    prompt = [rng.randrange(256) for _ in range(30)]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0, ignore_eos=True)
    llm = LLM(folder, dtype="float32", device="cpu", num_blocks=32, block_size=8, enable_stage_output_cache=True)
    first, second = (llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
    assert second.num_cached_tokens > 0
    assert first.prompt_logprobs is not None and second.prompt_logprobs is not None
    lp = [next(iter(d.values())).logprob for d in first.prompt_logprobs[1:] if d is not None]
    lp2 = [next(iter(d.values())).logprob for d in second.prompt_logprobs[1:] if d is not None]
    assert len(lp) == len(prompt) - 1 and lp == pytest.approx(lp2, abs=1e-5)
    assert second.outputs[0].token_ids == first.outputs[0].token_ids == hf_generate(hf, prompt, 2)
    assert llm.llm_engine.kv_cache_manager.num_free_blocks == llm.llm_engine.num_blocks


def assert_same_logprobs(got: list[Any], want: list[Any], abs_tol: float) -> None:
    """Two engines' outputs of the same prompts (sampled with logprobs=0): each token's logprob
    within `abs_tol` - what greedy tokens alone can miss (a layer's error too small to flip them)."""
    for a, b in zip(got, want, strict=True):
        got_lp = [next(iter(d.values())).logprob for d in a.outputs[0].logprobs]
        want_lp = [next(iter(d.values())).logprob for d in b.outputs[0].logprobs]
        assert got_lp == pytest.approx(want_lp, abs=abs_tol)


def replay_against_eager(
    folder: Path | str, batches: list[list[list[int]]], expected: list[list[int]], kwargs: dict[str, Any]
) -> LLM:
    """An engine whose steps take the CUDA graphs' buffers (set up by the caller), scheduled ahead
    as a GPU runs it, generates each batch of prompts in turn (a later batch may hit what an
    earlier one cached): greedy tokens equal `expected` (one list per prompt, in order), each
    token's logprob an eager engine's within 1e-4 (what greedy tokens alone can miss: a layer's
    error too small to flip them), steps ran ahead, every block free after. Returns the LLM."""
    params = SamplingParams(temperature=0, max_tokens=len(expected[0]), ignore_eos=True, logprobs=0)
    llm = LLM(str(folder), **kwargs, async_scheduling=True)
    eager = LLM(str(folder), **kwargs, enforce_eager=True)
    got = [o for batch in batches for o in llm.generate(batch, params, use_tqdm=False)]
    want = [o for batch in batches for o in eager.generate(batch, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in got] == expected
    assert_same_logprobs(got, want, 1e-4)
    engine = llm.llm_engine
    assert engine.num_steps_ahead > 0
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
    return llm


def assert_adapter_equals_peft(tmp_path: Path, hf: Any, targets: list[str], seed: int) -> None:
    """A random LoRA adapter of `hf` on `targets`: the engine's greedy tokens with it equal PEFT's
    (and differ from the base model's), every block free after."""
    from prefixkv.lora import LoRARequest

    from ..lora.conftest import peft_greedy, write_adapter

    base, adapter = tmp_path / "base", tmp_path / "adapter"
    hf.save_pretrained(base, safe_serialization=True)
    _write_tokenizer(base)
    write_adapter(base, adapter, seed=seed, r=4, lora_alpha=8, target_modules=targets)
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (5, 19)]
    llm = LLM(str(base), dtype="float32", device="cpu", num_blocks=48, block_size=8, max_model_len=64, enable_lora=True)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.generate(prompts, params, lora_request=LoRARequest("a", 1, str(adapter)), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in out]
    assert got == peft_greedy(base, adapter, prompts, 6)
    assert got != peft_greedy(base, None, prompts, 6)
    engine = llm.llm_engine
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
