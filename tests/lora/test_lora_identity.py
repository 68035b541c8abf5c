"""Cache identity of adapters: no block shared across adapters, hits within one, new weights under
the same name never hit the old KV, a LoRA named X never meets a cache_salt X."""

from __future__ import annotations

import shutil

from prefixkv import LLM, SamplingParams
from prefixkv.cache.identity import block_extra_keys
from prefixkv.lora import LoRARequest
from prefixkv.request import Request

from .conftest import ADAPTERS, peft_greedy, write_adapter

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
ARGS = dict(dtype="float32", device="cpu", num_blocks=64, block_size=8, max_model_len=64, enable_lora=True)


def _gen(llm, prompt, lora):
    out = llm.generate([{"prompt_token_ids": prompt}], PARAMS, use_tqdm=False, lora_request=lora)[0]
    return out.num_cached_tokens, list(out.outputs[0].token_ids)


def test_no_hit_across_adapters_hits_within(lora_fixture):
    fx = lora_fixture
    llm = LLM(str(fx.base), **ARGS, max_loras=2, max_lora_rank=8)
    prompt = fx.prompts[0]
    a, b = LoRARequest("qv", 1, fx.adapters["qv"]), LoRARequest("all", 2, fx.adapters["all"])
    assert _gen(llm, prompt, a)[0] == 0
    assert _gen(llm, prompt, b)[0] == 0  # same prefix, other adapter: nothing shared
    assert _gen(llm, prompt, None)[0] == 0  # nor with the base model
    cached, tokens = _gen(llm, prompt, a)
    assert cached == (len(prompt) - 1) // 8 * 8 and cached > 0  # same adapter: hits
    assert tokens == peft_greedy(fx.base, fx.adapters["qv"], [prompt], 4)[0]
    assert _gen(llm, prompt, LoRARequest("qv", 9, fx.adapters["qv"]))[0] == cached  # the int id is no identity
    engine = llm.llm_engine
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


def test_new_weights_under_the_same_name_never_hit(lora_fixture, tmp_path):
    fx = lora_fixture
    path = tmp_path / "adapter"
    shutil.copytree(fx.adapters["qv"], path)
    llm = LLM(str(fx.base), **ARGS, max_loras=1, max_lora_rank=8)
    lora = LoRARequest("x", 1, str(path))
    prompt = fx.prompts[1]
    assert _gen(llm, prompt, lora)[0] == 0
    assert _gen(llm, prompt, lora)[0] > 0
    shutil.rmtree(path)
    write_adapter(fx.base, path, seed=999, **ADAPTERS["qv"])  # same name, same path, new weights
    cached, tokens = _gen(llm, prompt, lora)
    assert cached == 0
    assert tokens == peft_greedy(fx.base, str(path), [prompt], 4)[0]  # and the new weights are applied


def test_lora_name_never_collides_with_cache_salt():
    lora = Request("a", list(range(8)), lora_request=LoRARequest("X", 1, "/p", "d"))
    salt = Request("b", list(range(8)), cache_salt="X")
    assert block_extra_keys(lora, 0, 8, 0) != block_extra_keys(salt, 0, 8, 0)
    assert block_extra_keys(lora, 0, 8, 0) == (("lora", "X", "/p", "d"),)
    other_digest = Request("c", list(range(8)), lora_request=LoRARequest("X", 1, "/p", "e"))
    assert block_extra_keys(lora, 0, 8, 0) != block_extra_keys(other_digest, 0, 8, 0)


def test_removed_adapter_blocks_are_unreachable(lora_fixture):
    fx = lora_fixture
    llm = LLM(str(fx.base), **ARGS, max_loras=1, max_lora_rank=8)
    lora = LoRARequest("qv", 1, fx.adapters["qv"])
    prompt = fx.prompts[2]
    _, first = _gen(llm, prompt, lora)
    assert _gen(llm, prompt, lora)[0] > 0
    engine = llm.llm_engine
    base_cached = _gen(llm, fx.prompts[0], None)[0]  # a base-model prefix cached after the adapter's
    qv_blocks = [b.block_id for k, bs in engine.kv_cache_manager.block_pool.cached_blocks.items() if k[2] for b in bs]
    assert base_cached == 0 and qv_blocks
    assert engine.remove_lora("qv")
    # its blocks are free and uncached, first in the victim order, ahead of the base model's
    free_order = engine.kv_cache_manager.block_pool.eviction_policy.block_ids()
    assert set(free_order[: len(qv_blocks)]) == set(qv_blocks)
    assert not any(k[2] for k, _ in engine.kv_cache_manager.block_pool.cached_blocks.items())
    assert engine.lora_manager.adapters == {}  # no host copy kept of an adapter nobody uses
    cached, tokens = _gen(llm, prompt, lora)  # loaded again: same weights, fresh identity
    assert cached == 0 and tokens == first
    assert _gen(llm, prompt, lora)[0] > 0
    assert _gen(llm, fx.prompts[0], None)[0] > 0  # the base model's blocks survived the reload
    assert not engine.remove_lora("nope")


def test_adapter_removed_while_running_evicts_once_its_requests_end(lora_fixture):
    fx = lora_fixture
    llm = LLM(str(fx.base), **ARGS, max_loras=1, max_lora_rank=8)
    engine = llm.llm_engine
    lora = LoRARequest("qv", 1, fx.adapters["qv"])
    _gen(llm, fx.prompts[2], lora)
    engine.add_request(fx.prompts[2], PARAMS, request_id="r", lora_request=lora)
    engine.step()  # the running request holds the cached blocks it hit
    assert engine.remove_lora("qv")
    held = [b for k, bs in engine.kv_cache_manager.block_pool.cached_blocks.items() if k[2] for b in bs]
    assert held and all(b.ref_cnt > 0 for b in held) and engine.lora_manager.retired
    while engine.has_unfinished_requests():
        engine.step()
    assert not any(k[2] for k, _ in engine.kv_cache_manager.block_pool.cached_blocks.items())
    assert not engine.lora_manager.retired and engine.lora_manager.adapters == {}
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


def test_new_weights_retire_the_old_version(lora_fixture, tmp_path):
    fx = lora_fixture
    path = tmp_path / "adapter"
    shutil.copytree(fx.adapters["qv"], path)
    llm = LLM(str(fx.base), **ARGS, max_loras=1, max_lora_rank=8)
    engine = llm.llm_engine
    _gen(llm, fx.prompts[1], LoRARequest("x", 1, str(path)))
    old_ids = set(engine.lora_manager.adapters)
    shutil.rmtree(path)
    write_adapter(fx.base, path, seed=7, **ADAPTERS["qv"])
    engine.resolve_lora(LoRARequest("x", 1, str(path)), reload=True)
    assert not any(k[2] for k, _ in engine.kv_cache_manager.block_pool.cached_blocks.items())
    assert not old_ids & set(engine.lora_manager.adapters)  # the old version's host copy is gone


def test_request_output_carries_the_lora_request(lora_fixture):
    fx = lora_fixture
    llm = LLM(str(fx.base), **ARGS)
    lora = LoRARequest("qv", 1, fx.adapters["qv"])
    outs = llm.generate([{"prompt_token_ids": fx.prompts[0]}] * 2, PARAMS, use_tqdm=False, lora_request=[lora, None])
    assert outs[0].lora_request is lora and outs[1].lora_request is None
