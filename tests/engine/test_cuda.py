"""The engine on a CUDA device (skipped without one): greedy float32 outputs equal transformers'
(run on the CPU, the same oracle as tests/engine/test_correctness.py) with caching off, caching on
and shared prefixes, a tiny chunk budget and preemption; prompt logprobs too; bfloat16 (the
default dtype there) hits its cache and is reproducible run to run; no block is left held."""

from __future__ import annotations

import pytest
import torch

from prefixkv import LLM, SamplingParams
from prefixkv.config import EngineConfig
from prefixkv.engine.llm_engine import LLMEngine
from prefixkv.model import load_model

from ..conftest import hf_greedy
from .test_correctness import (
    MAX_NEW,
    check_prompt_logprobs,
    engine_for,
    hf_prompt_logprobs,
    run,
    run_prompt_logprobs,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(scope="module")
def cuda_lm():
    return load_model(None, dtype=torch.float32, device="cuda")


@pytest.fixture(scope="module")
def prompts(default_lm):
    tok = default_lm.tokenizer
    doc = "Prefix caching keeps the key and value tensors of a shared prompt so later requests skip them. " * 6
    mixed = ["Hello", "The capital of France is", "def fibonacci(n):\n   "]
    shared = [doc + q for q in ("Summarize this in one line:", "What is kept?", "1, 2, 3, 4,")]
    return [tok.encode(p) for p in mixed], [tok.encode(p) for p in shared]


@pytest.fixture(scope="module")
def expected(prompts, hf_ref_model):
    mixed, shared = prompts
    return [hf_greedy(hf_ref_model, p, MAX_NEW) for p in mixed], [hf_greedy(hf_ref_model, p, MAX_NEW) for p in shared]


def cuda_engine(loaded, **overrides) -> LLMEngine:
    return engine_for(loaded, device="cuda", **overrides)


def test_cuda_float32_greedy_equals_transformers_caching_off_and_on(cuda_lm, prompts, expected):
    assert run(cuda_engine(cuda_lm, enable_prefix_caching=False), prompts[0]) == expected[0]
    engine = cuda_engine(cuda_lm, enable_prefix_caching=True)
    assert run(engine, prompts[1]) == expected[1]
    assert run(engine, prompts[1]) == expected[1]  # everything but the tails cached now
    assert engine.prefix_cache_stats.hits > 0.5 * engine.prefix_cache_stats.queries


def test_cuda_chunked_prefill_and_preemption_equal_transformers(cuda_lm, prompts, expected):
    engine = cuda_engine(cuda_lm, max_num_batched_tokens=7)
    assert run(engine, prompts[0] + prompts[1][:1]) == expected[0] + expected[1][:1]
    longest = max(len(p) for p in prompts[1]) + MAX_NEW
    engine = cuda_engine(cuda_lm, num_blocks=-(-longest // 8) + 3, block_size=8, max_model_len=longest + 8)
    assert run(engine, prompts[1]) == expected[1]
    assert engine.scheduler.num_preemptions > 0


def test_cuda_prompt_logprobs_equal_transformers(cuda_lm, prompts, hf_ref_model):
    out = run_prompt_logprobs(cuda_engine(cuda_lm, max_num_batched_tokens=24), prompts[1][:1], k=3)[0]
    check_prompt_logprobs(out, hf_prompt_logprobs(hf_ref_model, prompts[1][0]), 3)


def test_cuda_bfloat16_default_dtype_hits_cache_and_reproduces():
    engine = LLMEngine(EngineConfig(device="cuda", num_blocks=256, max_model_len=1024))
    assert engine.dtype == torch.bfloat16  # vLLM's default on a GPU
    llm = LLM.from_engine(engine)
    doc = "A shared system prompt that every request of this test repeats word for word. " * 8
    prompts = [doc + q for q in ("Name a color.", "Name a fruit.", "Name a city.", "Count to five.")]
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=7)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, sampled)]
    # the same cache state and batch: the same seeded tokens (bfloat16 need not match a run that
    # read cached blocks instead - a different shape of work - so the cache is emptied first)
    assert llm.reset_prefix_cache()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sampled)] == first
    again = llm.generate(prompts, sampled)
    assert all(o.num_cached_tokens >= 16 * (len(o.prompt_token_ids) // 16 - 1) for o in again)
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
    assert engine.kv_cache_usage == 0.0


def test_cuda_gpu_memory_utilization_sizes_the_kv_cache():
    """vLLM's share of the card: weights + one step's measured activations + the KV cache stay
    within it, and the KV cache takes nearly all the rest."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    share = min(0.3, 0.8 * free / total)  # other test processes may hold some of the card
    llm = LLM(device="cuda", gpu_memory_utilization=share, max_model_len=2048)
    engine = llm.llm_engine
    kv_bytes = engine.num_blocks * engine.block_tensors.bytes_per_block
    held = torch.cuda.memory_allocated()
    assert held <= share * total, (held, share * total)
    # nearly all the rest went to the KV cache: what the share leaves unheld is one step's
    # activations, well under 4 GiB for this model
    assert share * total - held <= 4 << 30 and kv_bytes > 0.5 * share * total
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))[0]
    assert len(out.outputs[0].token_ids) == 8
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


def test_cuda_async_scheduling_equals_transformers_and_launches_without_waiting(
    cuda_lm, prompts, expected, monkeypatch
):
    """Async scheduling on the GPU: greedy float32 tokens equal transformers' eagerly and with the
    decode steps as CUDA graphs; and a decode step launched ahead over the graphs' buffers makes
    the host wait for nothing (torch's sync debug mode reports every synchronizing call), so the
    host books one step while the device computes the next."""
    import warnings

    engine = cuda_engine(cuda_lm, async_scheduling=True)
    assert run(engine, prompts[1]) == expected[1]
    assert engine.num_steps_ahead > 0

    monkeypatch.setenv("PREFIXKV_CUDA_GRAPHS", "capture")
    engine = cuda_engine(cuda_lm, async_scheduling=True, max_num_seqs=8)
    assert engine.runner.graphs is not None and engine.runner.graphs.graphs, "no graphs were captured"
    launch = engine.runner.launch
    waits: list[str] = []

    def watched(scheduler_output, previous=None):
        if not any(sr.input_from_previous for sr in scheduler_output.scheduled):
            return launch(scheduler_output, previous)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                pending = launch(scheduler_output, previous)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        waits.extend(str(w.message) for w in caught if "synchroniz" in str(w.message))
        return pending

    monkeypatch.setattr(engine.runner, "launch", watched)
    assert run(engine, prompts[0]) == expected[0]
    assert engine.num_steps_ahead > 0 and engine.runner.graphs.replays > 0
    assert not waits, waits[:3]
    # what chat clients send (temperature, top_p; top_k, min_p): launched ahead without a wait
    # too, and each seeded request draws what it draws in order
    sampled = [
        SamplingParams(temperature=0.7, top_p=0.9, seed=1, max_tokens=MAX_NEW, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, top_p=0.95, seed=2, max_tokens=MAX_NEW, ignore_eos=True),
        SamplingParams(temperature=0.8, min_p=0.05, seed=3, max_tokens=MAX_NEW, ignore_eos=True),
    ]
    steps_ahead = engine.num_steps_ahead
    ahead = run(engine, prompts[0], params=sampled)
    assert engine.num_steps_ahead > steps_ahead
    assert not waits, waits[:3]
    in_order = cuda_engine(cuda_lm, max_num_seqs=8)
    assert run(in_order, prompts[0], params=sampled) == ahead
    # penalties run ahead: the token in flight is read from the previous step's copy (an event's
    # wait, for that step alone), its count on the host; the same tokens as in order
    penalized = [
        SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=MAX_NEW, ignore_eos=True),
        SamplingParams(
            temperature=0.8, seed=4, frequency_penalty=0.6, presence_penalty=0.3, max_tokens=MAX_NEW, ignore_eos=True
        ),
        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
    ]
    steps_ahead = engine.num_steps_ahead
    ahead = run(engine, prompts[0], params=penalized)
    assert engine.num_steps_ahead > steps_ahead
    assert not waits, waits[:3]
    assert run(in_order, prompts[0], params=penalized) == ahead


def test_cuda_tier_copies_keep_outputs_and_make_the_host_wait_for_nothing(cuda_lm, prompts, expected, monkeypatch):
    """A CPU tier on the GPU with async scheduling: blocks are copied out through page-locked
    memory in stream order and sealed when their step is booked, and loaded back the same way
    (tiers/transfer.py). Greedy float32 tokens equal transformers' when the blocks are saved and
    when the pool has forgotten them and they come back from the tier; neither copy makes the host
    wait (torch's sync debug mode reports every synchronizing call); every block free."""
    import warnings

    engine = cuda_engine(cuda_lm, async_scheduling=True, kv_offloading_size=0.05)
    connector = engine.runner.kv_connector
    waits: list[str] = []
    copies = {"load": 0, "save": 0}

    def watched(name):
        copy = getattr(connector, name)

        def run_copy(plans):
            copies[name] += 1
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    got = copy(plans)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            waits.extend(f"{name}: {w.message}" for w in caught if "synchroniz" in str(w.message))
            return got

        return run_copy

    monkeypatch.setattr(connector, "load", watched("load"))
    monkeypatch.setattr(connector, "save", watched("save"))
    _, shared = prompts
    assert run(engine, shared) == expected[1]
    saves = next(t for t in engine.get_stats().kv_tiers if t.tier == "cpu").saves
    assert saves > 0 and copies["save"] > 0 and engine.num_steps_ahead > 0
    assert engine.reset_prefix_cache()  # the pool forgets; the tier keeps them
    assert run(engine, shared) == expected[1]
    assert copies["load"] > 0 and next(t for t in engine.get_stats().kv_tiers if t.tier == "cpu").hits > 0
    assert not waits, waits[:3]


def test_cuda_stage_output_cache_runs_ahead_over_a_tier(cuda_lm, prompts, expected, hf_ref_model, monkeypatch):
    """The stage-output cache on the GPU, scheduled ahead, over a CPU tier: a step's rows reach
    host memory in stream order and are written when it is booked, and cached rows read back go
    to the device in stream order (stage_outputs/store.py): neither makes the host wait. Greedy
    float32 tokens equal transformers'; after the pool forgets the blocks, prompt logprobs over the
    shared document - read back from the stage rows loaded from the tier - equal transformers' too;
    every block free."""
    import warnings

    engine = cuda_engine(cuda_lm, kv_offloading_size=0.05, enable_stage_output_cache=True)
    assert engine.async_scheduling
    stage = engine.scheduler.stage_outputs
    assert stage is not None
    waits: list[str] = []

    def watched(name):
        call = getattr(stage, name)

        def run_call(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    got = call(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            waits.extend(f"{name}: {w.message}" for w in caught if "synchroniz" in str(w.message))
            return got

        return run_call

    monkeypatch.setattr(stage, "stage", watched("stage"))  # a step's rows, towards the host
    monkeypatch.setattr(stage, "read", watched("read"))  # cached rows, to the device
    _, shared = prompts
    assert run(engine, shared) == expected[1]
    assert engine.num_steps_ahead > 0 and stage.num_rows_written > 0
    assert engine.reset_prefix_cache()  # the pool forgets; the tier keeps the blocks and their rows
    outs = run_prompt_logprobs(engine, shared[:2], k=2)
    for out, ids in zip(outs, shared[:2]):
        check_prompt_logprobs(out, hf_prompt_logprobs(hf_ref_model, ids), 2)
    assert stage.num_rows_read > 0 and next(t for t in engine.get_stats().kv_tiers if t.tier == "cpu").hits > 0
    assert not waits, waits[:3]


def test_cuda_speculative_decoding_equals_transformers_with_graphs_and_eager(cuda_lm, prompts, expected):
    """n-gram drafts on a GPU: a verification step is a chunk there (a mixed step, replayed where
    its graph was captured); greedy float32 outputs stay transformers', seeded ones plain
    decoding's, and the async default turns off with drafts on."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    for eager in (False, True):
        engine = cuda_engine(cuda_lm, speculative_config={**spec, "by_measured_cost": False}, enforce_eager=eager)
        assert not engine.async_scheduling
        assert run(engine, prompts[1]) == expected[1]
        assert engine.scheduler.spec_stats.num_accepted_tokens > 0
    seeded = [SamplingParams(temperature=0.7, seed=5, max_tokens=MAX_NEW, ignore_eos=True)]
    plain = run(cuda_engine(cuda_lm), prompts[1], params=seeded)
    assert run(cuda_engine(cuda_lm, speculative_config=spec), prompts[1], params=seeded) == plain
