"""Greedy outputs equal transformers' for the default model in float32 - with caching off, with
caching on and shared prefixes, with chunked prefill, under preemption, and with a degenerate
content hash. Prefix caching never changes outputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

from prefixkv import SamplingParams
from prefixkv.config import EngineConfig
from prefixkv.engine.llm_engine import LLMEngine

from ..conftest import hf_greedy
from . import fuzz_caching

T = TypeVar("T")
MAX_NEW = 12
DOC = (
    "Prefix caching keeps the key and value tensors of a shared prompt so that later requests "
    "skip recomputing them. " * 6
)
QUESTIONS = [
    "Summarize this in one line:",
    "What is kept?",
    "Translate to French:",
    "Who benefits? Answer:",
    "1, 2, 3, 4,",
]


def engine_for(loaded, **overrides) -> LLMEngine:
    cfg = dict(dtype="float32", device="cpu", num_blocks=256, block_size=16)
    cfg.update(overrides)
    return LLMEngine(EngineConfig(**cfg), loaded=loaded)


def run(
    engine: LLMEngine,
    prompts: list[list[int]],
    max_tokens: int = MAX_NEW,
    params: list[SamplingParams] | None = None,
) -> list[list[int]]:
    """Every prompt to the end, greedy unless `params` (taken in turn), checking no block is left held."""
    params = params or [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)]
    ids = [engine.add_request(p, params[i % len(params)]) for i, p in enumerate(prompts)]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks, "blocks leaked"
    return [done[i] for i in ids]


@pytest.fixture(scope="module")
def prompts(default_lm):
    tok = default_lm.tokenizer
    mixed = [
        "Hello",
        "The capital of France is",
        "def fibonacci(n):\n   ",
        "Once upon a time, in a land far away, there lived a dragon who loved numbers like 12345 and",
    ]
    shared = [DOC + q for q in QUESTIONS]
    return [tok.encode(p) for p in mixed], [tok.encode(p) for p in shared]


@pytest.fixture(scope="module")
def expected(prompts, hf_ref_model):
    mixed, shared = prompts
    return ([hf_greedy(hf_ref_model, p, MAX_NEW) for p in mixed], [hf_greedy(hf_ref_model, p, MAX_NEW) for p in shared])


def test_mixed_batch_caching_off_equals_transformers(default_lm, prompts, expected):
    engine = engine_for(default_lm, enable_prefix_caching=False)
    assert run(engine, prompts[0]) == expected[0]


def test_shared_prefixes_caching_on_equals_transformers(default_lm, prompts, expected):
    engine = engine_for(default_lm, enable_prefix_caching=True)
    assert run(engine, prompts[1]) == expected[1]  # one batch: later prompts hit in-flight blocks
    assert run(engine, prompts[1]) == expected[1]  # again: everything but the tails is cached
    assert engine.prefix_cache_stats.hits > 0.5 * engine.prefix_cache_stats.queries


def test_chunked_prefill_tiny_token_budget_equals_transformers(default_lm, prompts, expected):
    engine = engine_for(default_lm, max_num_batched_tokens=7)
    assert run(engine, prompts[0] + prompts[1][:2]) == expected[0] + expected[1][:2]


def test_preemption_tiny_kv_budget_equals_transformers(default_lm, prompts, expected):
    longest = max(len(p) for p in prompts[1]) + MAX_NEW
    engine = engine_for(default_lm, num_blocks=-(-longest // 8) + 3, block_size=8, max_model_len=longest + 8)
    assert run(engine, prompts[1][:3]) == expected[1][:3]
    assert engine.scheduler.num_preemptions > 0


def test_degenerate_content_hash_changes_nothing(default_lm, prompts, expected):
    engine = engine_for(default_lm, prefix_caching_hash_algo=lambda obj: b"\0" * 32, enable_kv_cache_events=True)
    assert run(engine, prompts[1]) == expected[1]
    assert run(engine, prompts[1][::-1]) == expected[1][::-1]


def test_caching_on_equals_caching_off_on_multi_turn(default_lm):
    """A follow-up turn re-sends prompt + answer: it hits blocks completed by generated tokens."""
    tok = default_lm.tokenizer
    first = tok.encode("<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n")
    outs = {}
    for caching in (False, True):
        engine = engine_for(default_lm, enable_prefix_caching=caching, block_size=4)
        answer = run(engine, [first], 20)[0]
        follow = first + answer + tok.encode("<|im_end|>\n<|im_start|>user\nAnd three more?<|im_end|>\n")
        outs[caching] = (answer, run(engine, [follow], 20)[0])
        if caching:
            assert engine.prefix_cache_stats.hits >= len(first) + 16  # generated blocks hit too
    assert outs[True] == outs[False]


def test_preempted_request_re_hits_its_own_blocks_on_resume(default_lm):
    """Preemption frees a victim's blocks but keeps their identity: with prompts that share
    nothing, a resumed request finds its own earlier blocks - counted apart from prefix-cache
    hits (vLLM's preempted fields), of which there are none."""
    tok = default_lm.tokenizer
    prompts = [tok.encode(f"Story {i}: " + "word " * 40) for i in range(3)]
    prompts = [p[:1] + [p[1] + i] + p[2:] for i, p in enumerate(prompts)]  # differ in block 0
    engine = engine_for(default_lm, num_blocks=20, block_size=8, max_model_len=150)
    run(engine, prompts, 40)
    assert engine.scheduler.num_preemptions > 0
    assert engine.prefix_cache_stats.preempted_hits > 0
    assert engine.prefix_cache_stats.hits == 0


# -- prompt logprobs ----------------------------------------------------------------------------
def hf_prompt_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def once_per_prompt(oracle: Callable[[list[int]], T]) -> Callable[[list[int]], T]:
    """`oracle`, computed once per prompt: for a module-scoped fixture whose tests share prompts
    (transformers' forward is the most expensive part of checking a short run)."""
    computed: dict[tuple[int, ...], T] = {}

    def get(ids: list[int]) -> T:
        key = tuple(ids)
        if key not in computed:
            computed[key] = oracle(ids)
        return computed[key]

    return get


@pytest.fixture(scope="module")
def hf_logprobs(hf_ref_model):
    """transformers' prompt logprobs, computed once per prompt in this module."""
    return once_per_prompt(lambda ids: hf_prompt_logprobs(hf_ref_model, ids))


def finished_outputs(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    """Every request to the end (params[i] for prompts[i]), its final RequestOutput; every block
    free after."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks, "blocks leaked"
    return [done[i] for i in ids]


def run_prompt_logprobs(engine: LLMEngine, prompts: list[list[int]], k: int, n: int = 1, max_tokens: int = 2) -> list:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, prompt_logprobs=k, n=n, ignore_eos=True)
    return finished_outputs(engine, prompts, [params] * len(prompts))


def check_prompt_logprobs(out, ref: torch.Tensor, k: int) -> None:
    ids = out.prompt_token_ids
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        row = ref[pos - 1]
        target = row[ids[pos]].item()
        assert entry[ids[pos]].logprob == pytest.approx(target, abs=1e-4)
        # the rank as transformers would give it, up to the same 1e-4: two kernels can order
        # tokens whose logprobs lie within float rounding of each other either way
        assert int((row > target + 1e-4).sum()) + 1 <= entry[ids[pos]].rank <= int((row > target - 1e-4).sum()) + 1
        top = torch.topk(row, k).indices.tolist() if k else []
        assert [t for t, lp in entry.items() if lp.rank <= k] == top or set(entry) >= set(top)
        assert len(entry) in (k, k + 1)


def test_prompt_logprobs_equal_transformers_and_bypass_cache_reads(default_lm, prompts, expected, hf_logprobs):
    """Prompt logprobs need logits at every prompt position, so the request computes its whole
    prompt even when the prefix is cached (as vLLM does), in chunks of a tiny token budget."""
    shared = prompts[1][:2]
    engine = engine_for(default_lm, max_num_batched_tokens=24)
    run(engine, shared[:1], max_tokens=1)  # the document is now cached (one token: caching needs no more)
    hits_before = engine.prefix_cache_stats.hits
    outs = run_prompt_logprobs(engine, shared, k=3)
    for out, ids in zip(outs, shared):
        assert out.num_cached_tokens == 0
        check_prompt_logprobs(out, hf_logprobs(ids), 3)
    assert engine.prefix_cache_stats.hits == hits_before  # not looked up, not counted
    # ...but written: a plain request afterwards hits what they computed
    again = run_prompt_logprobs(engine, shared[:1], k=0)[0]
    assert again.num_cached_tokens == 0 and len(again.prompt_logprobs) == len(shared[0])
    assert run(engine, shared[:1]) == expected[1][:1]


def test_prompt_logprobs_survive_preemption_and_n_greater_than_one(default_lm, prompts, hf_logprobs):
    two = prompts[1][:2]
    per_prompt = -(-max(len(p) for p in two) // 8)
    # both prompts fit at admission, their answers do not: one is preempted and recomputed,
    # and the positions it had scored are not scored twice
    engine = engine_for(
        default_lm, num_blocks=2 * per_prompt + 1, block_size=8, max_model_len=8 * per_prompt + MAX_NEW + 8
    )
    outs = run_prompt_logprobs(engine, two, k=1, max_tokens=MAX_NEW)
    assert engine.scheduler.num_preemptions > 0
    for out, ids in zip(outs, two):
        check_prompt_logprobs(out, hf_logprobs(ids), 1)
    out = run_prompt_logprobs(engine_for(default_lm), two[:1], k=1, n=2)[0]
    assert len(out.outputs) == 2
    check_prompt_logprobs(out, hf_logprobs(two[0]), 1)


@pytest.mark.parametrize(
    ("family", "seed", "preempts"),
    [
        ("llama", 18, True),
        ("gemma3", 22, True),
        ("gpt_oss", 22, True),
        ("mamba2", 6, False),
        ("qwen3_next", 18, True),
        ("lfm2", 18, True),
        ("granite_hybrid", 22, True),
        ("lora", 5, False),
        ("llava", 0, True),
    ],
)
def test_random_traffic_with_caching_equals_without(tmp_path, family, seed, preempts):
    """Seeds of tests/engine/fuzz_caching.py (random traffic, an engine with caching off against
    one with it on): a conversation's next turns and repeated prompts beside preemption, for plain
    attention, sliding windows in a second KV-cache group (Gemma 3: 22 preempts ten times; gpt-oss's
    sinks beside them: six), and
    recurrent state restored from the cache (mamba2 6: two requests of one step, the second
    continuing from a block the first computes in it; LFM2's convolutions beside attention,
    preempted; Granite 4's mixers beside NoPE attention and experts, preempted); the same prompts under two adapters and
    none (lora 5: with the adapter out of the blocks' key, they read each other's KV); images at
    the same places in the same words (llava 0: with the image's hash out of the key, likewise)."""
    model = fuzz_caching.checkpoint(family, tmp_path)
    differ, hits, preemptions = fuzz_caching.differences(model, seed)
    assert not differ and hits > 0
    assert preemptions > 0 or not preempts
