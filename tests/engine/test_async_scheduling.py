"""Async scheduling (EngineArgs.async_scheduling, Scheduler.schedule_ahead, ModelRunner.launch):
each decode step is scheduled and launched before the previous step's tokens are read, its input
ids taken from that step's draws on the device. Outputs must equal the in-order engine's token for
token (greedy float32 against transformers too; seeded sampling; every kind of stop, aborts,
arrivals, penalties, constraints) and every block must be free afterwards."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from prefixkv import LLM, SamplingParams
from prefixkv.config import EngineConfig
from prefixkv.engine.llm_engine import LLMEngine

from ..conftest import hf_greedy
from ..model.test_model_hf_folder import _make, _write_tokenizer
from ..model.triton_interpreter import device, kernels_module
from . import fuzz_ahead

BASE: dict[str, Any] = dict(dtype="float32", device="cpu", num_blocks=64, block_size=8, max_model_len=96)


@pytest.fixture(scope="module")
def tiny() -> tuple[Path, Any]:
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="async-sched-"))
    hf = _make("llama")
    hf.save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder)
    return folder, hf


def _prompts(seed: int, n: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(20)]
    prompts = [shared + [rng.randrange(256) for _ in range(rng.randrange(1, 10))] for _ in range(n - 1)]
    return [*prompts, [rng.randrange(256) for _ in range(6)]]


def _outputs(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[tuple]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [
        (
            tuple(c.token_ids),
            c.text,
            c.finish_reason,
            c.stop_reason,
            None if c.logprobs is None else [{t: round(lp.logprob, 4) for t, lp in e.items()} for e in c.logprobs],
        )
        for o in outs
        for c in o.outputs
    ]


def _scored(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple]:
    """Each completion's tokens and, token by token, its logprob, rank and top logprobs (rounded)."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [
        (
            tuple(c.token_ids),
            None
            if c.logprobs is None
            else [sorted((t, round(lp.logprob, 4), lp.rank) for t, lp in e.items()) for e in c.logprobs],
        )
        for o in outs
        for c in o.outputs
    ]


def _first_fails_the_others_unharmed(llm: LLM, prompts: list[list[int]], params: SamplingParams, want: list) -> None:
    """The first prompt's request fails on its non-finite logits; the others give `want` (their
    outputs without it); every block is free after."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[0].error is not None and "non-finite" in outs[0].error
    got = [
        (tuple(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason, None)
        for o in outs[1:]
    ]
    assert got == want
    _all_free(llm)


def _over_graph_buffers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A random Llama checkpoint written in `tmp_path` (returned: transformers' model), its engines'
    steps over the CUDA graphs' buffers (uncaptured under Triton's interpreter on a CPU)."""
    kernels_module()
    monkeypatch.setenv("PREFIXKV_CUDA_GRAPHS", "static" if device().type == "cpu" else "capture")
    hf = _make("llama")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    return hf


def _all_free(llm: LLM) -> None:
    engine = llm.llm_engine
    assert engine._in_flight is None
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


def test_greedy_equals_transformers_and_steps_run_ahead(tiny):
    """Caching off and on (hits), chunked prefill (its chunks scheduled ahead too), preemption:
    greedy tokens equal transformers', steps were scheduled ahead, and every block is free after."""
    folder, hf = tiny
    prompts = _prompts(1)
    expected = [hf_greedy(hf, p, 14) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    for kwargs in (
        dict(enable_prefix_caching=False),
        dict(enable_prefix_caching=True),
        dict(max_num_batched_tokens=9),
        dict(num_blocks=12, max_model_len=48),
    ):
        llm = LLM(str(folder), **{**BASE, **kwargs}, async_scheduling=True)
        engine = llm.llm_engine
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == expected, kwargs
        assert engine.num_steps_ahead > 0, kwargs
        if "max_num_batched_tokens" in kwargs:  # prompts in chunks go on ahead: every step but the first
            assert engine.num_steps_ahead == engine.num_steps - 1, (engine.num_steps_ahead, engine.num_steps)
        _all_free(llm)
        if kwargs.get("num_blocks") == 12:
            assert engine.scheduler.num_preemptions > 0


def test_every_stop_and_sampling_equal_the_in_order_engine(tiny):
    """Stops on a token (stop_token_ids, a stop string, EOS), by count (max_tokens 1 / 2 / 7, the
    model's length), min_tokens, logprobs, seeded sampling with top-p / top-k / min-p and n=3: the same tokens,
    text, finish and stop reasons as steps run in order."""
    folder, _ = tiny
    prompts = _prompts(2, 8)
    sync = LLM(str(folder), **BASE)
    ahead = LLM(str(folder), **BASE, async_scheduling=True)
    probe = _outputs(sync, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    third = [toks[3] for toks, *_ in probe]  # each prompt's 4th greedy token: a stop mid-sequence
    text = [t for _, t, *_ in probe]
    params = [
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[third[0]], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, stop=[text[1][2:4]] if len(text[1]) > 4 else None),
        SamplingParams(temperature=0, max_tokens=1, logprobs=2),
        SamplingParams(temperature=0, max_tokens=2),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=9, logprobs=1),
        SamplingParams(temperature=1.2, top_k=5, seed=11, max_tokens=7, min_tokens=5, stop_token_ids=[third[5]]),
        SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),  # ends at max_model_len
        SamplingParams(temperature=0.7, min_p=0.05, seed=3, max_tokens=10, n=3),  # three sequences, one prompt
    ]
    want = _outputs(sync, prompts, params)
    steps_before = ahead.llm_engine.num_steps_ahead
    assert _outputs(ahead, prompts, params) == want
    assert ahead.llm_engine.num_steps_ahead > steps_before
    assert [w[2] for w in want].count("length") >= 3 and "stop" in [w[2] for w in want]
    _all_free(ahead)
    _all_free(sync)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemptions_ahead_equal_the_in_order_engine(tiny, policy):
    """A pool too small for the batch: steps scheduled ahead preempt (Scheduler.schedule_ahead)
    instead of falling back to in order, and a preempted request's token in flight is still
    booked. Greedy with a stop token, seeded sampling with logprobs, penalties, min_tokens and
    n=2: the same tokens, text, finishes and logprobs as the in-order engine, and every block free."""
    folder, _ = tiny
    prompts = _prompts(5, 8)
    small = {**BASE, "num_blocks": 14, "max_model_len": 48, "scheduling_policy": policy}
    sync = LLM(str(folder), **small)
    ahead = LLM(str(folder), **small, async_scheduling=True)
    probe = _outputs(LLM(str(folder), **BASE), prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    params = [
        SamplingParams(temperature=0, max_tokens=14, stop_token_ids=[probe[0][0][6]], ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=14, logprobs=2),
        SamplingParams(temperature=0, max_tokens=14, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, max_tokens=12, frequency_penalty=0.5, min_tokens=9),
        SamplingParams(temperature=0.7, top_k=8, seed=5, max_tokens=11, n=2),
    ]
    params = [params[i % len(params)] for i in range(len(prompts))]
    engine = ahead.llm_engine
    schedule_ahead = engine.scheduler.schedule_ahead
    preempted_ahead: list[str] = []

    def counted(in_flight, max_model_len):
        out = schedule_ahead(in_flight, max_model_len)
        if out is not None:
            preempted_ahead.extend(out.preempted_req_ids)
        return out

    engine.scheduler.schedule_ahead = counted  # type: ignore[method-assign]
    want = _outputs(sync, prompts, params)
    assert _outputs(ahead, prompts, params) == want
    assert sync.llm_engine.scheduler.num_preemptions > 0 and preempted_ahead
    assert engine.num_steps_ahead > 0.9 * engine.num_steps, (engine.num_steps_ahead, engine.num_steps)
    _all_free(ahead)
    _all_free(sync)


@pytest.mark.parametrize("seed", [8, 12, 17, 101])
def test_random_traffic_equals_the_in_order_engine(tiny, seed):
    """Seeds of tests/engine/fuzz_ahead.py (random traffic and configuration, in order against
    ahead): pools that preempt - a CPU tier under the priority policy (8), caching off (12), a CPU
    tier with prompts in chunks (17) - and the stage-output cache over a CPU tier, its rows read
    back by prompts in chunks (101)."""
    differ, steps_ahead, preemptions = fuzz_ahead.differences(tiny[0], seed)
    assert not differ and steps_ahead > 0 and (preemptions > 0 or seed == 101)


# requests whose prompt's logprobs or hidden states are asked, beside plain ones (prompt index, params)
_PROMPT_OUTPUT_PARAMS = [
    SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=3, logprobs=1),
    SamplingParams(temperature=0.8, seed=2, max_tokens=8, prompt_logprobs=0),
    SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5),
    SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1, repetition_penalty=1.3),
    SamplingParams(temperature=0, max_tokens=1),  # its prompt's hidden states from position 2
    # every position's hidden state, the generated ones too (a pipeline's thinker stage)
    SamplingParams(temperature=0.7, seed=4, max_tokens=7, return_hidden_states=True),
]


def _prompt_output_prompts() -> list[list[int]]:
    prompts = _prompts(9, 5)
    return [*prompts, prompts[0][:4] + prompts[1][4:], prompts[2][:3] + prompts[0][3:]]


def _with_prompt_outputs(llm: LLM, prompts: list[list[int]]) -> list[tuple]:
    """_PROMPT_OUTPUT_PARAMS over `prompts`, all but the first three arriving between steps: each
    request's tokens, finish reason, logprobs, prompt logprobs (rounded, with ranks) and hidden states."""

    def entries(lps: list | None) -> list | None:
        if lps is None:
            return None
        return [e and sorted((t, round(lp.logprob, 4), lp.rank) for t, lp in e.items()) for e in lps]

    engine = llm.llm_engine
    params = _PROMPT_OUTPUT_PARAMS
    for i in range(3):
        engine.add_request(prompts[i], params[i], request_id=str(i))
    done: dict[str, Any] = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps == 3:  # arrivals between steps: one scoring its prompt, one an embedding's
            for i in range(3, len(params)):
                hidden_from = 2 if i == 5 else None
                engine.add_request(prompts[i], params[i], request_id=str(i), hidden_states_from=hidden_from)
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return [
        (
            tuple(o.outputs[0].token_ids),
            o.outputs[0].finish_reason,
            entries(o.outputs[0].logprobs),
            entries(o.prompt_logprobs),
            None if o.hidden_states is None else [[round(v, 5) for v in row] for row in o.hidden_states.tolist()],
        )
        for _, o in sorted(done.items())
    ]


def test_prompt_logprobs_and_hidden_states_run_ahead(tiny):
    """Prompt logprobs and a prompt's hidden states (read with the step's tokens) do not keep a
    step in order: prompts in chunks scoring theirs, a whole prompt, max_tokens 1 (lm-eval's
    loglikelihood; an embedding's hidden states) and prompts arriving between steps beside plain
    decodes give the in-order engine's tokens, logprobs, prompt logprobs (each position once, its
    rank and top ones) and hidden states, and the steps after theirs were scheduled ahead, chunks
    included; every block free."""
    folder, _ = tiny
    prompts = _prompt_output_prompts()
    kwargs = dict(max_num_batched_tokens=16)  # the shared-prefix prompts take two chunks
    want = _with_prompt_outputs(LLM(str(folder), **BASE, **kwargs), prompts)
    assert all(want[i][3] is not None and len(want[i][3]) == len(prompts[i]) for i in (0, 1, 2, 4))
    assert want[5][4] is not None and len(want[5][4]) == len(prompts[5]) - 2
    assert want[6][4] is not None and len(want[6][4]) == len(prompts[6]) + 7 - 1
    llm = LLM(str(folder), **BASE, **kwargs, async_scheduling=True)
    scheduler = llm.llm_engine.scheduler
    ahead_of = {"scores": 0, "hidden states": 0, "chunks": 0, "decodes' hidden states": 0}
    schedule_ahead = scheduler.schedule_ahead

    def counted(in_flight: Any, max_model_len: int) -> Any:
        ahead = schedule_ahead(in_flight, max_model_len)
        if ahead is not None:
            ahead_of["scores"] += any(sr.sampling_params.prompt_logprobs is not None for sr in in_flight.scheduled)
            ahead_of["hidden states"] += any(sr.prompt_hidden_from is not None for sr in in_flight.scheduled)
            ahead_of["decodes' hidden states"] += any(sr.want_hidden_states and sr.sample for sr in ahead.scheduled)
            ahead_of["chunks"] += any(sr.want_hidden_states and not sr.sample for sr in ahead.scheduled)
        return ahead

    scheduler.schedule_ahead = counted
    assert _with_prompt_outputs(llm, prompts) == want
    assert all(ahead_of.values()), ahead_of
    _all_free(llm)


def test_hidden_states_of_sequences_that_stop_a_step_late(tiny):
    """return_hidden_states with a stop on a token: scheduled ahead, the step after the stop is
    computed too (the stop is seen when the tokens are read); its hidden row is dropped with its
    token, so every output has the in-order engine's rows (prompt then output but its last token)."""
    folder, _ = tiny
    prompts = _prompts(3, 3)
    sync = LLM(str(folder), **BASE)
    probe = _outputs(sync, prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    params = [
        SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[toks[3]], return_hidden_states=True)
        for toks, *_ in probe
    ]

    def run(llm: LLM) -> list[tuple]:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(tuple(o.outputs[0].token_ids), o.outputs[0].finish_reason, o.hidden_states.tolist()) for o in outs]

    want = run(sync)
    assert all(reason == "stop" for _, reason, _ in want)
    assert [len(rows) for *_, rows in want] == [len(p) + len(toks) - 1 for p, (toks, *_) in zip(prompts, want)]
    ahead = LLM(str(folder), **BASE, async_scheduling=True)
    assert run(ahead) == want
    assert ahead.llm_engine.num_steps_ahead > 0
    _all_free(ahead)


def test_prompt_outputs_of_replayed_steps_run_ahead(tmp_path, monkeypatch):
    """The same over the graphs' buffers, every step replayed (cudagraph_mode FULL): a prompt's
    logprobs and hidden states are taken from a replay's output before the step scheduled ahead
    rewrites it, so they equal the in-order engine's over the same kernels (the tokens the eager
    engine's too; its logprobs differ in the last bits)."""
    _over_graph_buffers(tmp_path, monkeypatch)
    prompts = _prompt_output_prompts()
    # (the seven requests fit 8 rows: the start-up check replays 7 decodes, not 15)
    config = dict(BASE, device=str(device()), max_num_batched_tokens=16, max_num_seqs=8)
    graphs = {"cudagraph_mode": "FULL", "cudagraph_capture_sizes": [1, 2, 4, 8, 16]}
    want = _with_prompt_outputs(
        LLM(str(tmp_path), **config, compilation_config=graphs, async_scheduling=False), prompts
    )
    eager = _with_prompt_outputs(LLM(str(tmp_path), **config, enforce_eager=True), prompts)
    assert [w[:2] for w in want] == [e[:2] for e in eager]
    llm = LLM(str(tmp_path), **config, compilation_config=graphs, async_scheduling=True)
    assert _with_prompt_outputs(llm, prompts) == want
    replayed = llm.llm_engine.runner.graphs
    assert replayed is not None and replayed.mixed_replays > 0 and llm.llm_engine.num_steps_ahead > 0
    _all_free(llm)


def test_min_tokens_and_an_eos_drawn_ahead(tiny, tmp_path):
    """EOS ids that greedy decoding reaches (a second one in generation_config.json): a request
    under min_tokens must not draw them in a step scheduled ahead, one without stops on them a
    step late; both equal the in-order engine."""
    import json
    import shutil

    folder, _ = tiny
    prompts = _prompts(7, 4)
    probe = _outputs(LLM(str(folder), **BASE), prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    eos = probe[0][0][2]  # prompt 0's third greedy token
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, eos]}))
    params = [
        SamplingParams(temperature=0, max_tokens=10, min_tokens=5),
        SamplingParams(temperature=0, max_tokens=10),
        SamplingParams(temperature=0, max_tokens=10, min_tokens=3),
        SamplingParams(temperature=0.9, seed=5, max_tokens=10, min_tokens=4),
    ]
    want = _outputs(LLM(str(tmp_path), **BASE), [prompts[0], *prompts[:3]], params)
    assert len(want[0][0]) >= 5 and eos not in want[0][0][:4]  # min_tokens kept it out
    assert want[1][2] == "stop" and len(want[1][0]) == 2  # without min_tokens it stops there
    ahead = LLM(str(tmp_path), **BASE, async_scheduling=True)
    assert _outputs(ahead, [prompts[0], *prompts[:3]], params) == want
    assert ahead.llm_engine.num_steps_ahead > 0
    _all_free(ahead)


def test_penalties_run_ahead_and_count_the_token_in_flight(tiny):
    """Penalties read a request's output so far, the token the step in flight draws included
    (read from its copy when the next step samples): greedy and seeded rows with repetition,
    frequency and presence penalties beside plain rows, with a request stopping on a token and
    n=2, give the in-order engine's tokens, logprobs and stops while the steps run ahead; every
    block free."""
    folder, _ = tiny
    prompts = _prompts(3, 4)
    sync = LLM(str(folder), **BASE)
    probe = _outputs(sync, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=1.5, logprobs=2),
        SamplingParams(temperature=0.9, seed=5, max_tokens=12, presence_penalty=1.2, repetition_penalty=1.3, n=2),
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[probe[3][0][4]], ignore_eos=True),
    ]
    want = _outputs(sync, prompts, params)
    # the penalties change these outputs: a token left uncounted would show
    assert want[0][0] != probe[0][0] and want[1][0] != probe[1][0]
    ahead = LLM(str(folder), **BASE, async_scheduling=True)
    assert _outputs(ahead, prompts, params) == want
    assert ahead.llm_engine.num_steps_ahead > 0
    _all_free(ahead)


def _two_token_word(tokenizer: Any, tokens: tuple[int, ...]) -> str | None:
    """The text of two consecutive output tokens (after the first) that encodes back to them alone,
    without spaces: a bad word whose ban depends on the token before."""
    for k in range(1, len(tokens) - 1):
        text = tokenizer.decode(tokens[k : k + 2])
        if text.isprintable() and not any(ch.isspace() for ch in text):
            if tokenizer.encode(text, add_special_tokens=False) == list(tokens[k : k + 2]):
                return text
    return None


def test_constraints_run_ahead_and_read_the_token_in_flight(tiny):
    """Constraints sample ahead too, reading the token in flight: a two-token bad word banned only
    after its first token (drawn by the step before), logit_bias, allowed_token_ids, and min_tokens
    beside them, greedy and seeded, give the in-order engine's outputs, edited on the host or as a
    GPU does (one bitmask a step); every block free."""
    folder, _ = tiny
    prompts = _prompts(3, 8)
    sync = LLM(str(folder), **BASE)
    probe = _outputs(sync, prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    tok = sync.get_tokenizer()
    pairs = [(i, w) for i, (toks, *_) in enumerate(probe) if (w := _two_token_word(tok, toks)) is not None]
    assert len(pairs) >= 2, probe
    (a, word_a), (b, word_b) = pairs[:2]
    allowed = sorted(set(probe[b][0]) | set(range(60, 90)))
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True) for _ in prompts]
    params[a] = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, bad_words=[word_a], logprobs=1)
    params[b] = SamplingParams(
        temperature=0.9, seed=4, max_tokens=10, bad_words=[word_b], allowed_token_ids=allowed, min_tokens=6
    )
    other = next(i for i in range(len(prompts)) if i not in (a, b))
    params[other] = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logit_bias={probe[other][0][2]: -9.0})
    want = _outputs(sync, prompts, params)
    assert want[a][0] != probe[a][0]  # the ban, which needs the token in flight, changed it
    for masks in (False, True):  # edited on the host, or through one bitmask as on a GPU
        ahead = LLM(str(folder), **BASE, async_scheduling=True)
        ahead.llm_engine.runner.constraint_masks = masks
        assert _outputs(ahead, prompts, params) == want, masks
        assert ahead.llm_engine.num_steps_ahead > 0
        _all_free(ahead)


def test_aborts_and_arrivals_between_steps(tiny):
    """Requests aborted while a step is in flight drop out (their blocks free), requests added
    between steps are admitted behind the decodes of a step scheduled ahead, and the rest equal
    the in-order engine's."""
    folder, _ = tiny
    prompts = _prompts(4, 6)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def run(engine: LLMEngine) -> dict[str, tuple[int, ...]]:
        done: dict[str, tuple[int, ...]] = {}
        for i in range(3):
            engine.add_request(prompts[i], params, request_id=f"r{i}")
        steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = tuple(out.outputs[0].token_ids)
            steps += 1
            if steps == 3:
                engine.abort_request("r1")
                engine.add_request(prompts[3], params, request_id="r3")
            if steps == 5:
                engine.add_request(prompts[4], params, request_id="r4")
                engine.abort_request(["r0", "nobody"])
        return done

    sync = LLM(str(folder), **BASE).llm_engine
    ahead = LLM(str(folder), **BASE, async_scheduling=True).llm_engine
    want = run(sync)
    assert run(ahead) == want
    assert set(want) == {"r2", "r3", "r4"}
    # only the first step ran in order (and one whose requests all end): arrivals join steps ahead
    assert ahead.num_steps - ahead.num_steps_ahead <= 2, (ahead.num_steps, ahead.num_steps_ahead)
    assert ahead._in_flight is None
    assert ahead.kv_cache_manager.num_free_blocks == ahead.num_blocks

    # every request aborted while a step is in flight: nothing is left running on their blocks
    for i in range(2):
        ahead.add_request(prompts[i], params, request_id=f"x{i}")
    for _ in range(4):
        ahead.step()
    assert ahead._in_flight is not None
    ahead.abort_request(["x0", "x1"])
    assert ahead._in_flight is None
    assert ahead.kv_cache_manager.num_free_blocks == ahead.num_blocks

    def aborted_while_scored(engine: LLMEngine) -> dict[str, tuple[int, ...]]:
        """A prompt in chunks scoring its logprobs and keeping its hidden states, aborted after
        the first step (under async scheduling its next chunk is then in flight, and booked after)."""
        scored = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)
        engine.add_request(prompts[0], scored, request_id="scored", hidden_states_from=1)
        engine.add_request(prompts[1], params, request_id="plain")
        engine.step()
        if engine.async_scheduling:
            assert engine._in_flight is not None
            assert any(sr.want_hidden_states for sr in engine._in_flight[0].scheduled)
        engine.abort_request("scored")
        done: dict[str, tuple[int, ...]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = tuple(out.outputs[0].token_ids)
        assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
        return done

    chunks = dict(BASE, max_num_batched_tokens=8)
    want = aborted_while_scored(LLM(str(folder), **chunks).llm_engine)
    assert aborted_while_scored(LLM(str(folder), **chunks, async_scheduling=True).llm_engine) == want
    assert set(want) == {"plain"}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_non_finite_row_fails_alone(tiny, async_scheduling, temperature):
    """A row of NaN logits fails its request ("non-finite"); its batch's others go on unharmed -
    checked before sampling in order, when the tokens are read ahead. Greedy, and seeded random
    draws (which a NaN row would make raise)."""
    folder, _ = tiny
    prompts = _prompts(5, 3)
    params = SamplingParams(temperature=temperature, seed=7, max_tokens=8, ignore_eos=True)
    want = _outputs(LLM(str(folder), **BASE), prompts[1:], params)
    llm = LLM(str(folder), **BASE, async_scheduling=async_scheduling)
    engine = llm.llm_engine
    model = engine.runner.model
    compute_logits = model.compute_logits
    calls = {"n": 0}

    def broken_first_row(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        calls["n"] += 1
        if calls["n"] == 4 and len(logits) == 3:  # a decode step of all three
            logits = logits.clone()
            logits[0] = float("nan")
        return logits

    model.compute_logits = broken_first_row
    _first_fails_the_others_unharmed(llm, prompts, params, want)
    assert calls["n"] >= 4


def test_the_decode_buffers_take_the_carried_tokens(tmp_path, monkeypatch):
    """With the decode steps over fixed buffers (CUDA graphs' inputs; on a CPU the same buffers,
    not captured, under Triton's interpreter) the carried tokens go into the buffers' ids on the
    device: greedy tokens equal transformers'."""
    hf = _over_graph_buffers(tmp_path, monkeypatch)
    prompts = _prompts(6, 3)
    expected = [hf_greedy(hf, p, 8) for p in prompts]
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        device=str(device()),
        num_blocks=32,
        block_size=8,
        max_model_len=64,
        async_scheduling=True,
        # the buffers for a batch of 8 at most: every size is run once at start, and under the
        # interpreter vLLM's default sizes (1, 2, 4, 8, ..., 256) took 89 s
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]},
    )
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    engine = llm.llm_engine
    assert engine.runner.graphs is not None and engine.runner.graphs.replays > 0
    assert engine.num_steps_ahead > 0
    _all_free(llm)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_non_finite_row_of_a_replayed_decode_fails_alone(tmp_path, monkeypatch, async_scheduling, temperature):
    """The same over the decode graphs' buffers, whose graph runs the LM head, the row checks and
    the argmax (cuda_graphs.DecodeTail): a row of NaN logits fails its request, the others' tokens
    are those of a run without it - greedy ones the graph's argmax, seeded draws from its logits."""
    _over_graph_buffers(tmp_path, monkeypatch)
    prompts = _prompts(6, 3)
    config = dict(BASE, device=str(device()), compilation_config={"cudagraph_capture_sizes": [1, 2, 4]})
    # (four tokens: three decode steps, the first of the three rows broken, two after it without)
    params = SamplingParams(temperature=temperature, seed=7, max_tokens=4, ignore_eos=True)
    want = _outputs(LLM(str(tmp_path), **config), prompts[1:], params)
    llm = LLM(str(tmp_path), **config, async_scheduling=async_scheduling)
    graphs = llm.llm_engine.runner.graphs
    assert graphs is not None and graphs.tail_rows == 4
    model = llm.llm_engine.runner.model
    compute_logits = model.compute_logits
    broken = {"steps": 0}

    def broken_first_row(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        if len(logits) == 4 and broken["steps"] == 0 and graphs.replays:  # a replayed decode of the three
            broken["steps"] += 1
            logits = logits.clone()
            logits[0] = float("nan")
        return logits

    model.compute_logits = broken_first_row
    _first_fails_the_others_unharmed(llm, prompts, params, want)
    assert broken["steps"] == 1


def _constrained(prompts: list[list[int]], tok: Any, probe: list[tuple]) -> list[SamplingParams]:
    """Constraints of every kind over `prompts` (whose greedy outputs are `probe`), some rows
    penalized too: a two-token bad word, allowed_token_ids with min_tokens, logit_bias, each greedy
    or seeded."""
    word = next(w for toks, *_ in probe if (w := _two_token_word(tok, toks)) is not None)
    allowed = sorted(set(range(40, 120)) | {257})
    return [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, bad_words=[word], repetition_penalty=1.5),
        SamplingParams(temperature=0.9, seed=3, max_tokens=8, allowed_token_ids=allowed, min_tokens=5),
        SamplingParams(
            temperature=0.8,
            top_p=0.9,
            seed=4,
            max_tokens=8,
            ignore_eos=True,
            logit_bias={65: 4.0},
            frequency_penalty=1.0,
        ),
        SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=allowed, min_tokens=3, presence_penalty=1.5),
    ][: len(prompts)]


def test_penalized_and_constrained_rows_draw_in_the_graphs(tmp_path, monkeypatch):
    """Over the decode graphs' buffers, penalized and constrained rows (one bitmask a step, as on a
    GPU) are drawn by the draws' graph from the logits edited in place: the in-order eager
    engine's outputs, the draws taken by the graph, every block free; penalized rows alone too.
    Then a row whose logits are not finite only at tokens its constraints rule out (the edit hides
    that from the draws' graph, so the check is the raw logits'): its request fails alone, as in
    the eager engine, the others unharmed."""
    _over_graph_buffers(tmp_path, monkeypatch)
    prompts = _prompts(8, 4)
    sync = LLM(str(tmp_path), **BASE, enforce_eager=True)
    probe = _outputs(sync, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    params = _constrained(prompts, sync.get_tokenizer(), probe)
    want = _outputs(sync, prompts, params)
    llm = LLM(str(tmp_path), **BASE, async_scheduling=True, compilation_config={"cudagraph_capture_sizes": [1, 2, 4]})
    graphs = llm.llm_engine.runner.graphs
    assert graphs is not None and graphs.tail_rows == 4
    llm.llm_engine.runner.constraint_masks = True
    assert _outputs(llm, prompts, params) == want
    assert graphs.draws > 0 and llm.llm_engine.num_steps_ahead > 0
    _all_free(llm)
    penalized = [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.8),
        SamplingParams(temperature=0.9, seed=5, max_tokens=8, ignore_eos=True, frequency_penalty=1.5),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, presence_penalty=2.0),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    ]
    draws = graphs.draws
    assert _outputs(llm, prompts, penalized) == _outputs(sync, prompts, penalized)
    assert graphs.draws > draws
    _all_free(llm)
    # logprobs beside the edits: the raw logits' (each token's, its rank, the top ones), as the
    # eager sampler scores them, the tokens still drawn from the edited logits in the graph
    scored = [p.clone(logprobs=k) for p, k in zip(params + penalized, (3, None, 0, 5, 2, 1, None, 4))]
    draws = graphs.draws
    for batch in (scored[:4], scored[4:]):
        assert _scored(llm, prompts, batch) == _scored(sync, prompts, batch)
    assert graphs.draws > draws
    _all_free(llm)

    params[0] = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, allowed_token_ids=list(range(100)))
    want = want[1:]
    forward = graphs._forward
    broken = {"steps": 0}

    def nan_where_ruled_out(kind: str, size: int) -> torch.Tensor:
        """A decode of the four whose LM head (in the graph) gave row 0 a NaN at token 200, which
        row 0 may not draw: its row check in the graph says so."""
        hidden = forward(kind, size)
        if kind.startswith("decode") and size == 4 and broken["steps"] == 0:
            broken["steps"] += 1
            graphs.logits[0, 200] = float("nan")
            graphs._tails[kind, size][0][0] = False
        return hidden

    graphs._forward = nan_where_ruled_out
    draws = graphs.draws
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[0].error is not None and "non-finite" in outs[0].error
    assert [
        (tuple(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason, None)
        for o in outs[1:]
    ] == want
    assert broken["steps"] == 1 and graphs.draws > draws
    _all_free(llm)


def _stage_traffic(folder: Path, tier: bool) -> tuple[list[tuple], dict[str, Any]]:
    """Requests over one document for an engine with the stage-output cache, in order of arrival
    (step, id, prompt, params, hidden_states_from): two decode the document on (its last block
    completed by a step scheduled before its last token was known); with a CPU tier, others then
    fill the pool so that its blocks go to the tier; then prompts that are the document and its
    continuation ask for their hidden states or prompt logprobs, behind one that asks for
    neither, beside one decoding - cache hits whose rows are read back (loaded from the tier, with
    one)."""
    rng = random.Random(5)
    doc = [rng.randrange(256) for _ in range(20)]
    greedy = SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)
    cfg: dict[str, Any] = dict(
        dtype="float32",
        device="cpu",
        block_size=8,
        num_blocks=14 if tier else 64,
        max_model_len=48,
        max_num_batched_tokens=32,
        enable_stage_output_cache=True,
        kv_offloading_size=0.01 if tier else None,
    )
    once = LLMEngine(EngineConfig(model=str(folder), dtype="float32", device="cpu", max_model_len=48))
    rid = once.add_request(doc, greedy)
    cont: list[int] = []
    while once.has_unfinished_requests():
        cont = next((list(o.outputs[0].token_ids) for o in once.step() if o.request_id == rid), cont)
    once.shutdown()
    fill = [[rng.randrange(256) for _ in range(30)] for _ in range(3)] if tier else []
    traffic = [
        (0, "doc", doc, greedy, None),
        (0, "other", doc[:9] + [7, 8, 9], SamplingParams(temperature=0, max_tokens=6), None),
        *[(16 + i, f"fill{i}", p, SamplingParams(temperature=0, max_tokens=4), None) for i, p in enumerate(fill)],
        (26, "running", [9] * 8, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), None),
        (30, "plain", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3), None),
        (30, "scored", doc + cont[:12] + [3], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2), None),
        (30, "embed", doc + cont[:12], SamplingParams(temperature=0, max_tokens=1), 0),
        (31, "thinker", doc + cont[:5], SamplingParams(temperature=0, max_tokens=6, return_hidden_states=True), None),
        (34, "after", doc + cont[:12] + [4, 4], SamplingParams(temperature=0, max_tokens=5), None),
    ]
    return traffic, cfg


def _serve_stage(
    folder: Path, cfg: dict[str, Any], traffic: list[tuple], ahead: bool
) -> tuple[dict, LLMEngine, dict[str, int]]:
    """Each request's outputs, the engine, and the step each request finished in."""
    engine = LLMEngine(EngineConfig(model=str(folder), **cfg, async_scheduling=ahead))
    pending, done, step = list(traffic), {}, 0
    finished_at: dict[str, int] = {}
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params, hidden_from = pending.pop(0)
            engine.add_request(prompt, params, request_id=rid, hidden_states_from=hidden_from)
        for out in engine.step():
            if out.finished:
                c, hidden = out.outputs[0], out.hidden_states
                done[out.request_id] = (
                    tuple(c.token_ids),
                    fuzz_ahead._scores(out.prompt_logprobs),
                    None if hidden is None else hidden.double().sum(dim=1).tolist(),
                    out.error,
                )
                finished_at[out.request_id] = step
        step += 1
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
    return done, engine, finished_at


@pytest.mark.parametrize("tier", [False, True])
def test_the_stage_output_cache_runs_ahead(tiny, tier):
    """With the stage-output cache its rows are written when a step is booked, and the tiers' share
    of them moves then (stage_outputs/store.py, tiers/transfer.py): steps run ahead, a step that
    reads cached rows runs in order, and the outputs - hidden states and prompt logprobs read
    back over cache hits, from blocks completed by steps scheduled ahead or loaded from a CPU tier
    - equal the in-order engine's, with as many rows read, and an engine's that caches nothing."""
    folder, _ = tiny
    traffic, cfg = _stage_traffic(folder, tier)
    in_order, slow, in_order_at = _serve_stage(folder, cfg, traffic, False)
    ahead, fast, ahead_at = _serve_stage(folder, cfg, traffic, True)
    uncached = dict(cfg, enable_prefix_caching=False, enable_stage_output_cache=False, kv_offloading_size=None)
    computed, _, _ = _serve_stage(folder, uncached, traffic, False)
    # ahead, a step's outputs come with the next step; a request reading rows its own step loads
    # from the tier waits one step more, for a step in order (not for the running request to end)
    assert all(ahead_at[r] <= in_order_at[r] + 2 for r in in_order_at), (in_order_at, ahead_at)
    assert fast.async_scheduling and fast.num_steps_ahead > 5
    assert set(in_order) == set(ahead) == set(computed) == {t[1] for t in traffic}
    for got in (in_order, ahead):
        assert all(fuzz_ahead.close(computed[r], got[r]) for r in got), [
            r for r in got if not fuzz_ahead.close(computed[r], got[r])
        ]
    assert all(out[3] is None for out in ahead.values())
    for engine in (slow, fast):  # rows read back, with a tier some of them loaded from it
        assert engine.scheduler.stage_outputs is not None
        assert engine.scheduler.stage_outputs.num_rows_read >= 3 * 8
        assert not tier or engine.get_stats().kv_tiers[0].hits > 0
    assert fast.scheduler.stage_outputs.num_rows_read == slow.scheduler.stage_outputs.num_rows_read


@pytest.mark.slow(seconds=15)
@pytest.mark.parametrize("kind", ["qwen3_next", "gemma3"])
def test_recurrent_and_sliding_window_models_run_ahead(kind, tmp_path):
    """Blocks that hold more than K/V rows written once, scheduled ahead: a recurrent layer's state
    per block (Qwen3-Next's delta nets; the step computed ahead for a request stopping on a token
    overwrites its last block's state) and KV-cache groups (Gemma 3: sliding layers' blocks leave
    the window, and go back to the pool, while the step before still runs). Requests stopping mid-
    block, then the same prompts again over what the first round cached: the same tokens, stops
    and (within float32 rounding: a decode may share a step with another request's chunk in one
    engine and not the other) logprobs as in order, every block free."""
    if kind == "gemma3":
        from .test_hybrid_attention import _make as make_sliding

        hf = make_sliding(kind)
    else:
        from .test_recurrent_graphs import _make as make_recurrent

        hf = make_recurrent(kind)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    prompts = _prompts(4, 6)
    sync = LLM(str(tmp_path), **BASE)
    ahead = LLM(str(tmp_path), **BASE, async_scheduling=True)
    probe = _outputs(sync, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    params = [
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[toks[2 + i]], ignore_eos=True, logprobs=1)
        for i, (toks, *_) in enumerate(probe[:4])
    ] + [
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=9, logprobs=1),
        SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, logprobs=1),  # far past the window
    ]
    for _ in range(2):
        want, got = _outputs(sync, prompts, params), _outputs(ahead, prompts, params)
        assert [w[:4] for w in want] == [g[:4] for g in got]
        for w, g in zip(want, got):
            for a, b in zip(w[4], g[4]):
                assert list(a) == list(b) and list(a.values()) == pytest.approx(list(b.values()), abs=2e-4)
    assert "stop" in [w[2] for w in want]
    engine = ahead.llm_engine
    assert engine.async_scheduling and engine.num_steps_ahead > 0 and engine.prefix_cache_stats.hits > 0
    assert engine.scheduler.num_kv_groups == (2 if kind == "gemma3" else 1)
    _all_free(ahead)
