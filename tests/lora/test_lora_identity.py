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
    assert llm.llm_engine.lora_manager.remove("qv")
    cached, tokens = _gen(llm, prompt, lora)  # loaded again: same weights, fresh identity
    assert cached == 0 and tokens == first
    assert _gen(llm, prompt, lora)[0] > 0
