"""Which mixed steps replay a CUDA graph, chosen by timing them against eager steps
(engine/mixed_graph_choice.py): the policy the flags give, the rule, the timing loop, and an engine
that times its mixed steps over the fixed buffers (on a CPU under Triton's interpreter), keeps the
answer, reads it at the next start instead of timing again, and routes steps by it."""

from __future__ import annotations

import json
import logging
import random
import time
from types import SimpleNamespace

import pytest
import torch

from prefixkv import LLM, SamplingParams
from prefixkv.engine import mixed_graph_choice
from prefixkv.engine.graph_check import compare
from prefixkv.engine.mixed_graph_choice import (
    ENV,
    REPS,
    MixedTiming,
    StoredChoice,
    measure,
    policy,
    replay_limit,
    timing_step,
)
from prefixkv.model import load_model

from ..conftest import hf_greedy
from ..model.test_model_hf_folder import _make, _write_tokenizer
from ..model.triton_interpreter import device, kernels_module


def test_policy_from_the_flags(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert policy("capture", None) == "measured"  # a GPU's default
    assert policy("capture", {"cudagraph_capture_sizes": [8]}) == "measured"
    assert policy("static", None) == "none"  # a CPU checking the buffers asks by name
    assert policy(None, {"cudagraph_mode": "FULL"}) == "none"  # no graphs at all
    assert policy("capture", {"cudagraph_mode": "FULL"}) == "all"
    assert policy("static", {"cudagraph_mode": "full_and_piecewise"}) == "all"
    assert policy("capture", {"cudagraph_mode": "FULL_DECODE_ONLY"}) == "none"
    monkeypatch.setenv(ENV, "measured")
    assert policy("static", {"cudagraph_mode": "FULL_DECODE_ONLY"}) == "measured"
    assert policy(None, None) == "none"
    monkeypatch.setenv(ENV, "None")
    assert policy("capture", {"cudagraph_mode": "FULL"}) == "none"
    monkeypatch.setenv(ENV, "sometimes")
    with pytest.raises(ValueError, match=ENV):
        policy("capture", None)


def test_the_limit_is_the_largest_count_won_there_and_at_every_smaller_one():
    T = MixedTiming
    assert replay_limit([]) == 0
    assert replay_limit([T(8, 2, 1.0, 2.0)]) == 0
    wins_then_loses = [T(8, 2, 5.0, 1.0), T(16, 9, 5.0, 2.0), T(32, 17, 5.0, 6.0), T(64, 33, 9.0, 8.0)]
    assert replay_limit(wins_then_loses) == 16  # a win past a loss does not count
    assert replay_limit([T(16, 9, 2.0, 2.0), T(8, 2, 3.0, 1.0)]) == 16  # a tie replays; any order


def test_each_count_is_timed_at_the_fewest_tokens_that_pad_to_it_until_the_first_loss():
    calls: list[tuple[str, int]] = []

    def eager(step):
        calls.append(("eager", step[0]))
        time.sleep(0.005)
        return torch.ones(step[0], 4)

    def replay(step):
        calls.append(("replay", step[0]))
        if step[0] > 16:
            time.sleep(0.03)  # replays lose from 32 on
        return torch.ones(64, 4)  # a padded step's rows: the first ones are the step's

    timings, wrong = measure([1, 8, 16, 32, 64], lambda n: [n], eager, replay, lambda: None)
    assert wrong is None
    # 1: a one-token step is a decode; 64 is not timed: 32 lost
    assert [(t.size, t.tokens) for t in timings] == [(8, 2), (16, 9), (32, 17)]
    assert replay_limit(timings) == 16 and timings[-1].replay_ms > timings[-1].eager_ms
    assert calls.count(("eager", 17)) == calls.count(("replay", 17)) == REPS + 1  # the compared run first
    # a pool that cannot hold a step ends the timing there
    timings, _ = measure([8, 16, 32], lambda n: [n] if n <= 8 else None, eager, eager, lambda: None)
    assert [t.size for t in timings] == [8]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_replay_that_disagrees_with_the_eager_step_ends_the_timing(dtype):
    states = torch.randn(40, 8, generator=torch.Generator().manual_seed(0))

    def eager(step):
        time.sleep(0.003)  # slower than any replay here: only a disagreement ends the timing
        return states[: step[0]].to(dtype)

    def rounded(step):  # another order of additions: within rounding
        return (states[: step[0]] * (1 + 1e-6)).to(dtype)

    def wrong_from(first_wrong):
        def replay(step):
            out = states[: step[0]].clone()
            if step[0] >= first_wrong:
                out[-1] = 0.0  # one row not computed
            return out.to(dtype)

        return replay

    timings, wrong = measure([8, 16, 32], lambda n: [n], eager, rounded, lambda: None, dtype)
    assert wrong is None and [t.size for t in timings] == [8, 16, 32]
    timings, wrong = measure([8, 16, 32], lambda n: [n], eager, wrong_from(9), lambda: None, dtype)
    assert [t.size for t in timings] == [8]
    assert wrong is not None and "the replay of 16 rows (9 tokens) disagreed" in wrong
    nan = measure([8], lambda n: [n], eager, lambda step: torch.full((step[0], 8), float("nan")), lambda: None)
    assert nan[1] is not None


def test_a_timing_step_is_prompts_that_fit_the_buffers():
    step = timing_step(20, 8, 64, 1, 50, max_len=8, max_seqs=4)
    assert step is not None
    assert [len(r.token_ids) for r in step] == [8, 8, 4] and [r.start for r in step] == [0, 0, 0]
    assert [r.block_table for r in step] == [[0], [1], [2]]
    assert [r.group_block_tables for r in step] == [[[0]], [[1]], [[2]]]
    assert all(0 <= t < 50 for r in step for t in r.token_ids) and not any(r.sample for r in step)
    assert timing_step(20, 8, 64, 0, 50, max_len=8, max_seqs=2) is None  # more prompts than sequences
    assert timing_step(20, 8, 2, 0, 50, max_len=8, max_seqs=4) is None  # more blocks than the pool
    assert [len(r.token_ids) for r in timing_step(9, 4, 64, 0, 50, max_len=64, max_seqs=4)] == [9]


@pytest.fixture
def measured_static(monkeypatch, tmp_path):
    """The fixed buffers without a capture on a CPU (Triton's interpreter), mixed steps timed; the
    answers kept in a folder of the test's own."""
    kernels_module()
    monkeypatch.setenv("PREFIXKV_CUDA_GRAPHS", "static" if device().type == "cpu" else "capture")
    monkeypatch.setenv(ENV, "measured")
    answers = tmp_path / "answers"
    monkeypatch.setattr(mixed_graph_choice, "answer_path", lambda kind, parts: answers / f"{hash(tuple(parts))}.json")
    return answers


@pytest.mark.slow(seconds=20)
def test_an_engine_times_its_mixed_steps_keeps_the_answer_and_routes_steps_by_it(tmp_path, measured_static, caplog):
    """The first engine times its mixed steps' replays against eager steps and keeps what it found;
    the next start reads it (no timing), captures only the counts it keeps and replays the steps up
    to its limit, the larger ones eagerly: greedy float32 tokens equal transformers' either way,
    every block free after."""
    folder = tmp_path / "model"
    hf = _make("llama")
    hf.save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder)
    rng = random.Random(42)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (5, 12, 27)]
    lengths = [4, 3, 5]
    expected = [hf_greedy(hf, p, n) for p, n in zip(prompts, lengths)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    args = dict(
        dtype="float32", device=str(device()), num_blocks=64, block_size=8, max_model_len=48, max_num_seqs=4,
        max_num_batched_tokens=32,
    )  # fmt: skip
    caplog.set_level(logging.INFO, logger="prefixkv")
    llm = LLM(str(folder), **args)
    graphs = llm.llm_engine.runner.graphs
    assert graphs is not None
    kept = list(measured_static.iterdir())
    assert len(kept) == 1
    answer = json.loads(kept[0].read_text())
    timings = [MixedTiming(**t) for t in answer["timings"]]
    assert timings and timings[0].size == 8 and timings[0].tokens == 2  # the ladder's first count, its fewest tokens
    assert answer["replay_limit"] == replay_limit(timings)
    assert graphs.mixed_sizes == [s for s in (8, 16, 32) if s <= answer["replay_limit"]]
    assert "timed on this" in caplog.text and graphs.mixed_replays == 0  # timing steps are not served steps
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    del llm

    # an answer of 16 kept for this engine's shapes: the next start reads it and times nothing
    model_config = load_model(str(folder), dtype=torch.float32, device=device()).config
    StoredChoice(device(), model_config, torch.float32, 8, 4, [8, 16, 32], (8192, 48)).keep(16, [])
    caplog.clear()
    llm = LLM(str(folder), **args)
    engine = llm.llm_engine
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.mixed_sizes == [8, 16]
    assert "measured before on this" in caplog.text and "each count checked now" in caplog.text
    assert "timed on this" not in caplog.text
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert graphs.mixed_replays > 0  # the 5- and 12-token prompts' steps
    runner = engine.runner

    def prompt(n):
        return [SimpleNamespace(token_ids=[1] * n, start=0, block_table=[0, 1, 2], lora_id=0, mm_inputs=())]

    assert runner.graph_kind(prompt(16)) == "mixed" and runner.graph_kind(prompt(17)) is None
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


@pytest.mark.slow(seconds=10)
@pytest.mark.parametrize("measured_before", [False, True])
def test_a_replay_computing_wrong_states_leaves_mixed_steps_eager(
    tmp_path, measured_static, caplog, monkeypatch, measured_before
):
    """A mixed graph whose forward goes wrong (its first row zeroed: a row the kernel never wrote)
    is caught by the comparison at start-up, at the first start (before any timing) and at a later
    one (an answer on disk: each kept count compared again): mixed steps run eagerly, with a
    warning, nothing new is kept, and the outputs are transformers'."""
    from prefixkv.engine.cuda_graphs import StepGraphs

    folder = tmp_path / "model"
    hf = _make("llama")
    hf.save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder)
    if measured_before:
        model_config = load_model(str(folder), dtype=torch.float32, device=device()).config
        StoredChoice(device(), model_config, torch.float32, 8, 4, [8, 16, 32], (8192, 48)).keep(16, [])
    kept = sorted(p.read_text() for p in measured_static.glob("*.json"))
    real = StepGraphs._forward

    def broken(self, kind, size):
        hidden = real(self, kind, size)
        if kind.startswith("mixed"):
            hidden[0].zero_()
        return hidden

    monkeypatch.setattr(StepGraphs, "_forward", broken)
    caplog.set_level(logging.INFO, logger="prefixkv")
    llm = LLM(
        str(folder), dtype="float32", device=str(device()), num_blocks=64, block_size=8, max_model_len=48,
        max_num_seqs=4, max_num_batched_tokens=32,
    )  # fmt: skip
    graphs = llm.llm_engine.runner.graphs
    assert graphs is not None and graphs.mixed_sizes == []
    assert "mixed steps run eagerly: the replay of 8 rows (2 tokens) disagreed" in caplog.text
    assert sorted(p.read_text() for p in measured_static.glob("*.json")) == kept  # nothing new kept
    prompt = [5, 17, 99, 3, 42, 7, 8, 9, 10, 11, 12]
    got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert got[0].outputs[0].token_ids == hf_greedy(hf, prompt, 4)
    assert graphs.mixed_replays == 0


@pytest.mark.slow(seconds=4)
def test_a_timing_step_past_the_buffers_width_replays_as_several_prompts(tmp_path, measured_static, monkeypatch):
    """Contexts of at most 16 tokens, mixed steps of up to 64: the larger counts are timed over
    prompts that each fit the width (a replayed step's contexts must), and such a replay agrees
    with the eager step."""
    monkeypatch.setenv(ENV, "all")  # every count captured, none timed: the step is run by hand
    hf = _make("llama")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    llm = LLM(
        str(tmp_path), dtype="float32", device=str(device()), num_blocks=64, block_size=8, max_model_len=12,
        max_num_seqs=8, max_num_batched_tokens=64,
    )  # fmt: skip
    runner = llm.llm_engine.runner
    graphs = runner.graphs
    assert graphs is not None and graphs.max_context == 16 and graphs.mixed_sizes[-1] == 64
    assert not graphs.failed  # the decode check ran over one-block prefills
    step = timing_step(49, 8, 64, 0, hf.config.vocab_size, graphs.max_context, 8)
    assert step is not None and [len(r.token_ids) for r in step] == [16, 16, 16, 1]
    assert graphs.kind(step) == "mixed"
    wrong = compare(lambda: runner.eager_hidden(step), lambda: graphs.run(step, kind="mixed")[0], torch.float32, "64")
    assert wrong is None


def test_the_flag_on_an_eager_engine_is_said_to_change_nothing(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(ENV, "all")
    monkeypatch.delenv("PREFIXKV_CUDA_GRAPHS", raising=False)
    hf = _make("llama")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    caplog.set_level(logging.INFO, logger="prefixkv")
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", num_blocks=16, block_size=8, max_model_len=32)
    assert llm.llm_engine.runner.graphs is None
    assert f"{ENV} changes nothing here" in caplog.text
