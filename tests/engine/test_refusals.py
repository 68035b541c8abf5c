"""Refuse, never ignore: every vLLM argument or field prefixkv does not implement gets a clear
ValueError naming it (each of these was once accepted and did nothing); arguments that change
nothing here are accepted. One EngineArgs generates both the CLI flags and the LLM keywords."""

from __future__ import annotations

import argparse

import pytest

from prefixkv import LLM, LoRARequest, SamplingParams
from prefixkv.cache import POLICIES
from prefixkv.config import EngineConfig
from prefixkv.engine.llm_engine import LLMEngine
from prefixkv.engine_args import EngineArgs

GREEDY = SamplingParams(temperature=0, max_tokens=4)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(tensor_parallel_size=2), "tensor_parallel_size"),
        (dict(pipeline_parallel_size=2), "pipeline_parallel_size"),
        (dict(cpu_offload_gb=4), "cpu_offload_gb"),
        (dict(quantization="awq"), "quantization"),
        (dict(enable_chunked_prefill=False), "enable_chunked_prefill"),
        (dict(kv_cache_dtype="fp8"), "kv_cache_dtype"),
        (dict(revision="main"), "revision"),
        (dict(speculative_config={"method": "mtp", "num_speculative_tokens": 1}), "speculative_config method='mtp'"),
        (dict(speculative_config={"model": "draft-1b", "num_speculative_tokens": 4}), "draft models"),
        (dict(limit_mm_per_prompt={"video": 1}), "limit_mm_per_prompt"),
        (dict(hf_overrides={"x": 1}), "hf_overrides"),
        (dict(scheduling_policy="lifo"), "scheduling_policy"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(max_logprobs=-1), "max_logprobs"),
        (dict(eviction_policy="nope"), "eviction_policy"),
        (dict(cpu_thread_policy="static"), "cpu_thread_policy"),
        (dict(dtype="int4"), "dtype"),
    ],
)
def test_llm_refuses_what_it_would_ignore(kwargs, name):
    with pytest.raises(ValueError, match=name):
        LLM(**kwargs)  # refused before any model is loaded


def test_llm_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="not_an_argument"):
        LLM(not_an_argument=1)


def test_arguments_that_change_nothing_are_accepted():
    args = EngineArgs(
        trust_remote_code=True,
        enforce_eager=True,
        gpu_memory_utilization=0.5,
        swap_space=0,
        disable_log_stats=True,
        enable_chunked_prefill=True,
        tensor_parallel_size=1,
        kv_sharing_fast_prefill=True,  # (always on for the models it concerns: exact here)
        seed=3,
    )
    assert args.enable_chunked_prefill is True and args.seed == 3


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(use_beam_search=True), "use_beam_search"),
        (dict(best_of=3), "best_of"),
        (dict(guided_decoding={"json": {}}), "guided_decoding"),
        (dict(logits_processors=[print]), "logits_processors"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),  # -1 or >= 1
        (dict(spaces_between_special_tokens=False), "spaces_between_special_tokens"),
    ],
)
def test_sampling_params_refuse_unimplemented_vllm_fields(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)
    # their defaults change nothing
    SamplingParams(use_beam_search=False, best_of=None, logit_bias=None, spaces_between_special_tokens=True)


def test_sampling_params_unknown_field_is_a_type_error():
    with pytest.raises(TypeError):
        SamplingParams(not_a_field=1)


@pytest.fixture(scope="module")
def llm(default_lm):
    return LLM.from_engine(
        LLMEngine(EngineConfig(dtype="float32", device="cpu", num_blocks=32, max_model_len=256), loaded=default_lm)
    )


@pytest.mark.parametrize(
    "call, name",
    [
        (
            lambda llm: llm.generate({"prompt": "x", "multi_modal_data": {"image": object()}}, GREEDY),
            "multi_modal_data",
        ),
        (lambda llm: llm.generate({"prompt": "x", "prompt_embeds": [0.1]}, GREEDY), "prompt_embeds"),
        (lambda llm: llm.generate({"prompt": "x", "whatever": 1}, GREEDY), "whatever"),
        (lambda llm: llm.generate("x", GREEDY, lora_request=LoRARequest("a", 1, "/no/such/path")), "LoRA"),
        (lambda llm: llm.generate("x", GREEDY, lora_request=LoRARequest("a", 1, ".")), "enable_lora"),
        (lambda llm: llm.generate("x", GREEDY, guided_options_request={"guided_json": {}}), "guided"),
        (lambda llm: llm.generate("x", GREEDY, priority=[1]), "priority"),
        (lambda llm: llm.chat([{"role": "user", "content": "x"}], GREEDY, documents=[{"text": "a"}]), "documents"),
        (
            lambda llm: llm.chat([{"role": "user", "content": "x"}], GREEDY, continue_final_message=True),
            "add_generation_prompt",
        ),
        (lambda llm: llm.llm_engine.add_request("x", GREEDY, lora_request=LoRARequest("a", 1, ".")), "LoRA"),
        # nothing says which tokens are reasoning without a reasoning parser
        (
            lambda llm: llm.generate("x", SamplingParams(thinking_token_budget=4)),
            "thinking_token_budget needs a reasoning parser",
        ),
    ],
)
def test_generate_refuses_unimplemented_inputs(llm, call, name):
    with pytest.raises(ValueError, match=name):
        call(llm)
    assert not llm.llm_engine.has_unfinished_requests()


def test_generate_unknown_keyword_is_a_type_error(llm):
    with pytest.raises(TypeError, match="use_tqdm_please"):
        llm.generate("x", GREEDY, use_tqdm_please=True)


def test_prompt_dict_cache_salt_is_used(llm):
    prompt = "A prompt long enough to fill a block or two of the cache, salted per prompt. " * 2
    llm.generate(prompt, GREEDY)
    same = llm.generate({"prompt": prompt}, GREEDY)[0]
    salted = llm.generate({"prompt": prompt, "cache_salt": "tenant-a"}, GREEDY)[0]
    assert same.num_cached_tokens > 0 and salted.num_cached_tokens == 0


def test_cli_flags_and_llm_keywords_come_from_one_dataclass():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    default = EngineArgs.from_cli_args(parser.parse_args([]))
    assert default == EngineArgs()  # the CLI's defaults are the dataclass's
    args = EngineArgs.from_cli_args(
        parser.parse_args(
            ["m", "--eviction-policy", "lfu", "--max-logprobs", "5", "--enable-kv-cache-events", "--trust-remote-code"]
        )
    )
    assert (args.model, args.eviction_policy, args.max_logprobs, args.enable_kv_cache_events) == ("m", "lfu", 5, True)
    assert set(POLICIES) <= set(next(a.choices for a in parser._actions if a.dest == "eviction_policy"))
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineArgs.from_cli_args(parser.parse_args(["--tensor-parallel-size", "2"]))


def test_eviction_policy_reaches_the_cache_manager(default_lm):
    engine = LLMEngine(
        EngineConfig(dtype="float32", device="cpu", num_blocks=16, max_model_len=128, eviction_policy="lfu"),
        loaded=default_lm,
    )
    assert type(engine.kv_cache_manager.block_pool.eviction_policy) is POLICIES["lfu"]
    out = LLM.from_engine(engine).generate("Hello", GREEDY)[0]
    assert out.outputs[0].token_ids


def test_an_engine_runs_where_the_model_it_is_handed_lives(default_lm):
    """A model handed in loaded decides the device and dtype left to the engine (a CPU model on a
    machine with CUDA once got its KV cache on the GPU); a configured one that contradicts it is
    refused by name."""
    import torch

    engine = LLMEngine(EngineConfig(num_blocks=16, max_model_len=128), loaded=default_lm)
    assert engine.device.type == "cpu" and engine.dtype == torch.float32  # default_lm: float32 on the CPU
    with pytest.raises(ValueError, match="dtype='bfloat16' but the model handed to the engine is torch.float32"):
        LLMEngine(EngineConfig(dtype="bfloat16", num_blocks=16, max_model_len=128), loaded=default_lm)
    with pytest.raises(ValueError, match="device='cuda' but the model handed to the engine is on cpu"):
        LLMEngine(EngineConfig(device="cuda", num_blocks=16, max_model_len=128), loaded=default_lm)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CUDA is here")
def test_cuda_asked_for_where_there_is_none_is_a_value_error():
    with pytest.raises(ValueError, match="device='cuda' but CUDA is not available here"):
        LLM(device="cuda", max_model_len=128)
