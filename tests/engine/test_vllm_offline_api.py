"""vLLM's offline API pieces: runner=, prefixkv.inputs' TextPrompt / TokensPrompt,
SamplingParams.output_kind (RequestOutputKind) at the engine, the async engine and LLM.generate,
and SamplingParams.extra_args."""

from __future__ import annotations

import asyncio
import random

import pytest

from prefixkv import LLM, RequestOutputKind, SamplingParams, TextPrompt, TokensPrompt
from prefixkv.config import EngineConfig
from prefixkv.engine.llm_engine import LLMEngine
from prefixkv.engine_args import EngineArgs
from prefixkv.sampling_params import RepetitionDetectionParams
from prefixkv.server.async_engine import AsyncEngine

PROMPT = "Write a short story about a lighthouse keeper and a storm."


@pytest.fixture(scope="module")
def llm(default_lm):
    return LLM.from_engine(
        LLMEngine(EngineConfig(dtype="float32", device="cpu", num_blocks=128, max_model_len=512), loaded=default_lm)
    )


@pytest.fixture(autouse=True)
def no_blocks_held_after(llm):
    yield
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


@pytest.mark.parametrize("runner", ["auto", "generate", "pooling"])
def test_runner_is_accepted_like_task(runner):
    assert EngineArgs.from_kwargs(None, runner=runner).runner == runner


def test_runner_draft_is_refused_by_name():
    with pytest.raises(ValueError, match="runner='draft' is not supported"):
        LLM(runner="draft")  # refused before any model loads


def test_text_and_tokens_prompts(llm):
    greedy = SamplingParams(temperature=0, max_tokens=6)
    ids = llm.llm_engine.tokenize(PROMPT)
    plain = llm.generate(PROMPT, greedy)[0]
    by_text = llm.generate(TextPrompt(prompt=PROMPT), greedy)[0]
    by_ids = llm.generate(TokensPrompt(prompt_token_ids=ids), greedy)[0]
    named = llm.generate(TokensPrompt(prompt_token_ids=ids, prompt=PROMPT), greedy)[0]
    for out in (by_text, by_ids, named):
        assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert (by_text.prompt, by_ids.prompt, named.prompt) == (PROMPT, None, PROMPT)
    long = PROMPT * 4  # whole blocks, so a repeat hits the cache
    assert llm.generate(TextPrompt(prompt=long), greedy)[0].num_cached_tokens == 0
    assert llm.generate(TextPrompt(prompt=long), greedy)[0].num_cached_tokens > 0
    assert llm.generate(TextPrompt(prompt=long, cache_salt="tenant-b"), greedy)[0].num_cached_tokens == 0
    with pytest.raises(ValueError, match="mm_processor_kwargs"):
        llm.generate(TokensPrompt(prompt_token_ids=ids, mm_processor_kwargs={}), greedy)  # type: ignore[typeddict-unknown-key]


def _drive(engine, prompt, params):
    rid = engine.add_request(prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def _params(kind, **kw):
    return SamplingParams(
        temperature=0.8, seed=7, n=2, max_tokens=12, logprobs=2, ignore_eos=True, output_kind=kind, **kw
    )


def test_output_kinds_at_the_engine(llm):
    engine = llm.llm_engine
    cumulative = _drive(engine, PROMPT, _params(RequestOutputKind.CUMULATIVE))
    assert len(cumulative) > 2 and cumulative[-1].finished
    final = cumulative[-1]

    only = _drive(engine, PROMPT, _params(RequestOutputKind.FINAL_ONLY))
    assert len(only) == 1 and only[0].finished  # no partial output
    for a, b in zip(only[0].outputs, final.outputs):
        assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)

    deltas = _drive(engine, PROMPT, _params(RequestOutputKind.DELTA))
    assert len(deltas) == len(cumulative) and deltas[-1].finished
    assert all(not d.finished for d in deltas[:-1])
    for want in final.outputs:
        parts = [c for d in deltas for c in d.outputs if c.index == want.index]
        assert "".join(c.text for c in parts) == want.text
        assert [t for c in parts for t in c.token_ids] == want.token_ids
        assert [e for c in parts for e in c.logprobs] == want.logprobs
        assert parts[-1].cumulative_logprob == pytest.approx(want.cumulative_logprob)
        assert [c.finish_reason for c in parts].count(want.finish_reason) == 1  # said once, at the end
        assert all(c.token_ids or c.finish_reason for c in parts)  # nothing empty is sent


def test_stream_interval_gathers_tokens_between_outputs(llm):
    """vLLM's stream_interval: the first output at once, then one per `interval` new tokens (of
    all n sequences together), the last at the end; the same text and tokens in the end, and the
    deltas of DELTA add up to them. The engine's own interval is a floor a request may raise."""
    engine = llm.llm_engine
    final = _drive(engine, PROMPT, _params(RequestOutputKind.CUMULATIVE))[-1]
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        outs = _drive(engine, PROMPT, _params(kind, stream_interval=5))
        # 2 sequences, a token each a step: 2 tokens at once, then every 3 steps (6 >= 5), then the end
        assert [sum(len(o.token_ids) for o in out.outputs) for out in outs][:3] == (
            [2, 8, 14] if kind is RequestOutputKind.CUMULATIVE else [2, 6, 6]
        )
        assert len(outs) == 5 and outs[-1].finished and not any(o.finished for o in outs[:-1])
        for want in final.outputs:
            parts = [c for d in outs for c in d.outputs if c.index == want.index]
            if kind is RequestOutputKind.DELTA:
                assert [t for c in parts for t in c.token_ids] == want.token_ids
                assert "".join(c.text for c in parts) == want.text
            else:
                assert (parts[-1].token_ids, parts[-1].text) == (want.token_ids, want.text)
    engine.groups.stream_interval = 5  # the engine's floor (--stream-interval 5)
    try:
        assert len(_drive(engine, PROMPT, _params(RequestOutputKind.CUMULATIVE))) == 5
        assert len(_drive(engine, PROMPT, _params(RequestOutputKind.CUMULATIVE, stream_interval=2))) == 5
        assert len(_drive(engine, PROMPT, _params(RequestOutputKind.CUMULATIVE, stream_interval=12))) == 3
    finally:
        engine.groups.stream_interval = 1
    with pytest.raises(ValueError, match="stream_interval"):
        SamplingParams(stream_interval=0).verify()


def _first_repeat(tokens: list[int], low: int, high: int, count: int) -> int | None:
    """Brute force: the shortest prefix of `tokens` that ends in a pattern of `low`..`high` tokens
    repeated `count` times in a row."""
    for end in range(1, len(tokens) + 1):
        head = tokens[:end]
        for size in range(low, high + 1):
            if size * count <= end and head[end - size * count :] == head[end - size :] * count:
                return end
    return None


def test_repetition_detection_ends_a_looping_output_where_the_loop_shows(llm):
    """vLLM's repetition_detection: the output ends (finish_reason "repetition", stop_reason
    "repetition_detected") at the first token where its tail is a pattern repeated min_count
    times; the tokens up to there are those of the run without it. min_tokens comes first."""
    prompt = "one two one two one two one two one two one two"
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    for low, high, count in ((1, 4, 3), (2, 3, 2), (0, 6, 4)):
        rd = {"max_pattern_size": high, "min_pattern_size": low, "min_count": count}
        want = _first_repeat(plain.token_ids, max(low, 1), high, count)
        assert want is not None and want < 40  # the model loops: the check has something to find
        out = llm.generate(
            prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_detection=rd)
        )
        got = out[0].outputs[0]
        assert (got.finish_reason, got.stop_reason) == ("repetition", "repetition_detected")
        assert got.token_ids == plain.token_ids[:want]
        later = SamplingParams(
            temperature=0, max_tokens=40, ignore_eos=True, repetition_detection=rd, min_tokens=want + 1
        )
        assert len(llm.generate(prompt, later)[0].outputs[0].token_ids) > want
    # the check alone, on random short-alphabet sequences, against the brute force at every length
    rng = random.Random(0)
    for _ in range(300):
        low, count = rng.randint(0, 3), rng.randint(2, 4)
        high = rng.randint(max(low, 1), 5)
        params = RepetitionDetectionParams(max_pattern_size=high, min_pattern_size=low, min_count=count)
        tokens = [rng.randrange(3) for _ in range(30)]
        for n in range(1, 31):
            head = tokens[:n]
            ends_in_one = any(
                size * count <= n and head[n - size * count :] == head[n - size :] * count
                for size in range(max(low, 1), high + 1)
            )
            # vLLM's check stops at the first pattern length too long for the tokens: never a false
            # hit, and none missed once every length fits
            assert not params.repeats(head) or ends_in_one
            if n >= high * count:
                assert params.repeats(head) == ends_in_one
    for bad in ({"max_pattern_size": 2, "min_count": 1}, {"max_pattern_size": 1, "min_pattern_size": 2}, {"size": 2}):
        with pytest.raises(ValueError, match="repetition_detection"):
            SamplingParams(repetition_detection=bad)


def test_final_only_text_is_decoded_once_and_equals_the_streamed_text(llm):
    """FINAL_ONLY without stop strings skips the token-by-token detokenization (nobody reads the
    text before the end); its text is the same, also for a sequence cut short, and stop strings
    still stop it at the same place."""
    engine = llm.llm_engine
    final = _drive(engine, PROMPT, _params(RequestOutputKind.CUMULATIVE))[-1]
    rid = engine.add_request(PROMPT, _params(RequestOutputKind.FINAL_ONLY))
    group = engine.groups.groups[rid]
    assert all(state._stream is None for state in group.states)  # no incremental decode
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    assert [(c.text, c.token_ids) for c in outs[-1].outputs] == [(c.text, c.token_ids) for c in final.outputs]

    # cut short (a failed group's outputs carry the text so far): the same text as a stream's
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
        rid = engine.add_request(PROMPT, _params(kind))
        for _ in range(4):
            engine.step()
        group = engine.groups.groups[rid]
        engine.groups.fail(group, "cut short for the test")
        engine.groups.forget(group)
        if kind is RequestOutputKind.CUMULATIVE:
            streamed = [s.text for s in group.states]
        else:
            assert [s.text for s in group.states] == streamed and all(streamed)
    while engine.has_unfinished_requests():
        engine.step()

    # stop strings need the text as it grows: decoded token by token, stopped where a stream stops
    stop = final.outputs[0].text[10:14]
    want = _drive(engine, PROMPT, _params(RequestOutputKind.CUMULATIVE, stop=[stop]))[-1]
    got = _drive(engine, PROMPT, _params(RequestOutputKind.FINAL_ONLY, stop=[stop]))
    assert len(got) == 1
    assert [(c.text, c.token_ids, c.finish_reason) for c in got[0].outputs] == [
        (c.text, c.token_ids, c.finish_reason) for c in want.outputs
    ]
    assert want.outputs[0].finish_reason == "stop"


def test_each_step_books_one_latency_per_token_after_a_sequences_first(llm):
    """`last_step_inter_token_latencies` (the server's inter-token latency histogram): what the
    step just taken booked, whatever the output kind; the first token of a sequence books none."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, n=2, output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request(PROMPT, params)
    engine.add_request(PROMPT + " Again.", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    per_step = []
    while engine.has_unfinished_requests():
        engine.step()
        per_step.append(list(engine.last_step_inter_token_latencies))
    assert per_step[0] == []  # the prefill: every sequence's first token
    assert sum(len(s) for s in per_step) == 2 * (5 - 1) + (3 - 1)
    assert all(0.0 <= x < 60 for s in per_step for x in s)


def test_delta_prompt_logprobs_come_once(llm):
    engine = llm.llm_engine
    params = SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1, output_kind=RequestOutputKind.DELTA
    )
    outs = _drive(engine, PROMPT, params)
    assert len(outs) == 4
    assert len(outs[0].prompt_logprobs) == len(outs[0].prompt_token_ids)
    assert all(o.prompt_logprobs is None for o in outs[1:])


def test_async_engine_streams_deltas(llm):
    engine = llm.llm_engine
    full = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    ids = engine.tokenize(PROMPT)

    async def collect(kind):
        outs = []
        async for out in async_engine.generate(
            ids, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, output_kind=kind), f"r-{kind.name}"
        ):
            outs.append(out)
        return outs

    async_engine = AsyncEngine(engine)
    async_engine.start()
    try:
        deltas = asyncio.run(collect(RequestOutputKind.DELTA))
        finals = asyncio.run(collect(RequestOutputKind.FINAL_ONLY))
    finally:
        async_engine.shutdown()
    assert len(deltas) > 1 and "".join(o.outputs[0].text for o in deltas if o.outputs) == full.text
    assert len(finals) == 1 and finals[0].outputs[0].token_ids == full.token_ids


def test_llm_generate_returns_final_outputs_whatever_the_kind(llm):
    want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    assert len(want.token_ids) == 8
    for kind in RequestOutputKind:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, output_kind=kind)
        got = llm.generate([PROMPT, PROMPT], params)[1].outputs[0]
        assert (got.text, got.token_ids) == (want.text, want.token_ids)
        assert params.output_kind is kind  # the caller's params are not changed


def test_extra_args_are_carried(llm):
    params = SamplingParams(temperature=0, max_tokens=3, extra_args={"my_processor": {"k": 1}})
    assert params.clone(max_tokens=4).extra_args == {"my_processor": {"k": 1}}
    plain = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].token_ids
    assert llm.generate(PROMPT, params)[0].outputs[0].token_ids == plain  # nothing in prefixkv reads them
    with pytest.raises(ValueError, match="extra_args must be a dict"):
        SamplingParams(extra_args=["x"])
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind=1)


def test_base_model_output_has_no_lora_request(llm):
    assert llm.generate(PROMPT, SamplingParams(max_tokens=1))[0].lora_request is None
