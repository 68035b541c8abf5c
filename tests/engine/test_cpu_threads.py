"""Threads per step under CPU contention (prefixkv/engine/cpu_threads.py): the foreign load is
measured from a real busy neighbour process, the engine changes its thread count beside one, and
outputs are the same bit for bit whatever the count."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from prefixkv import LLM, SamplingParams
from prefixkv.engine.cpu_threads import HEAVY_STEP_TOKENS, ForeignLoad, threads_for

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="the foreign load is read from /proc/stat")

WORDS = "river mountain quiet engine paper lantern violet harbor copper signal garden winter".split()


def text(n: int, seed: int) -> str:
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(n))


@contextmanager
def busy_neighbour() -> Iterator[None]:
    """Another process spinning on one of our CPUs for as long as the block runs."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def outputs(llm: LLM, prompts: list[str]) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    res = llm.generate(prompts, params, use_tqdm=False)
    return [
        (list(o.outputs[0].token_ids), [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
        for o in res
    ]


def test_threads_for_quiet_decode_and_prefill():
    assert threads_for(4, 4, 0.0, 1) == 4  # nobody else: the configured count, whatever the step
    assert threads_for(4, 4, 0.2, 1) == 4  # noise below a quarter core is nobody
    assert threads_for(4, 4, 0.7, 8) == 3  # one core taken: decode leaves it to its owner
    assert threads_for(4, 4, 1.6, 8) == 2
    assert threads_for(2, 2, 3.0, 1) == 1  # never below one
    assert threads_for(2, 2, 0.7, HEAVY_STEP_TOKENS) == 2  # a long prefill keeps every thread
    assert threads_for(4, 16, 12.0, 1) == 4  # the busy cores are ones we do not use
    assert threads_for(4, 16, 12.6, 1) == 3
    assert threads_for(8, 4, 0.0, 1) == 8  # a deliberate oversubscription is the caller's, when quiet


def test_foreign_load_sees_a_busy_neighbour():
    with busy_neighbour():
        load = ForeignLoad(frozenset(os.sched_getaffinity(0)))
        assert load.available
        time.sleep(0.6)  # this process sleeps: whatever runs on our CPUs is someone else
        load.update(time.monotonic())
        assert load.cores >= 0.6, load.cores


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_outputs_do_not_depend_on_the_thread_count(dtype):
    """The premise of changing threads per step: logprobs bit for bit at 1, 2 and 4 threads (decode
    attention over 400+ keys splits its keys; the split must follow the data, not the threads)."""
    llm = LLM(dtype=dtype, max_model_len=1024, cpu_thread_policy="fixed", enable_prefix_caching=False)
    prompts = [text(420, 1), "Tell me a story.", text(60, 2), text(150, 3)]
    base = outputs(llm, prompts)
    single = outputs(llm, prompts[:1])  # one sequence: the fewest tasks, the most split
    for n in (1, 4):
        with torch_threads(n):
            assert outputs(llm, prompts) == base, f"{n} threads"
            assert outputs(llm, prompts[:1]) == single, f"{n} threads, one sequence"


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one thread has no fewer to drop to")
def test_engine_adapts_beside_a_neighbour_and_outputs_stay():
    prompts = [text(300, 4), "Write a haiku about rivers."]
    fixed = LLM(max_model_len=1024, cpu_thread_policy="fixed")
    want = outputs(fixed, prompts)
    assert fixed.llm_engine.get_stats().cpu_threads == 0  # fixed: nothing adapted, no gauge
    del fixed
    configured = torch.get_num_threads()
    with busy_neighbour():
        adaptive = LLM(max_model_len=1024)  # adaptive is the default; its first window spans the load
        got = outputs(adaptive, prompts)
    stats = adaptive.llm_engine.get_stats()
    assert stats.cpu_steps_adapted > 0  # the decode steps ran on fewer threads
    assert stats.cpu_foreign_load > 0.25
    assert got == want
    assert torch.get_num_threads() == configured  # idle again: the caller's count is back
    assert stats.cpu_threads == configured
