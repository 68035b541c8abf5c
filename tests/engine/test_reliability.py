"""What a hostile or careless client must not be able to do to the engine: leave a ghost request
behind, collide with another request's internal ids, poison the shared cache, crash a step with
a value that overflows, or take the rest of a batch down with its own failure."""

from __future__ import annotations

import pytest

from prefixkv import LLM, SamplingParams
from prefixkv.config import EngineConfig
from prefixkv.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
DOC = "A popular shared prefix about the history of caches and memory hierarchies. " * 4


@pytest.fixture(scope="module")
def engine(default_lm):
    return LLMEngine(
        EngineConfig(dtype="float32", device="cpu", num_blocks=160, block_size=16, max_model_len=512), loaded=default_lm
    )


@pytest.fixture(autouse=True)
def nothing_left_behind(engine):
    yield
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
    stats = engine.get_stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0


def run_all(engine: LLMEngine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def alone(engine: LLMEngine, prompt, params: SamplingParams) -> list[list[int]]:
    rid = engine.add_request(prompt, params)
    return [c.token_ids for c in run_all(engine)[rid].outputs]


def test_seed_out_of_range_leaves_no_ghost(engine):
    llm = LLM.from_engine(engine)
    with pytest.raises(ValueError, match="seed"):
        llm.generate("Hello", SamplingParams(seed=2**64, max_tokens=4))
    assert not engine.has_unfinished_requests()
    assert llm.generate("Hello", GREEDY)[0].outputs[0].token_ids  # the next generate works
    assert not engine.has_unfinished_requests()
    params = SamplingParams(max_tokens=4)
    params.seed = 2**64  # set after construction: the engine checks again before registering
    with pytest.raises(ValueError, match="seed"):
        llm.generate(["Hello", "World"], params)
    assert not engine.has_unfinished_requests()
    assert llm.generate("Hello", GREEDY)[0].outputs[0].token_ids


def test_largest_seed_with_n_wraps_instead_of_overflowing(engine):
    params = SamplingParams(seed=2**64 - 1, n=3, max_tokens=4, temperature=1.0)
    first = alone(engine, "Once upon a time", params)
    again = alone(engine, "Once upon a time", params)
    assert first == again and len(first) == 3


def test_a_failing_add_in_a_batch_registers_nothing(engine):
    llm = LLM.from_engine(engine)
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate(["fine", "also fine"], [GREEDY, SamplingParams(logprobs=10**6)])
    assert not engine.has_unfinished_requests()


def test_mutated_params_are_checked_again_at_admission(engine):
    params = SamplingParams(temperature=0.5)
    params.temperature = float("inf")
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request("Hello", params)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=1e308), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(top_k=True), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(min_p=float("inf")), "min_p"),
        (dict(presence_penalty=float("nan")), "presence_penalty"),
        (dict(frequency_penalty=3), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(repetition_penalty=1e-300), "repetition_penalty"),
        (dict(seed=2**64), "seed"),
        (dict(seed=-(2**63) - 1), "seed"),
        (dict(seed=1.5), "seed"),
        (dict(seed=True), "seed"),
        (dict(n=True), "n must"),
        (dict(n=2.0), "n must"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(max_tokens=1.5), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=2.5), "min_tokens"),
        (dict(logprobs=True), "logprobs"),
        (dict(stop_token_ids=[True]), "stop_token_ids"),
        (dict(ignore_eos="yes"), "ignore_eos"),
        (dict(stop=5), "stop"),
    ],
)
def test_sampling_values_out_of_range_are_refused_by_name(bad, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad)


def test_logprob_counts_are_capped_by_the_engine_up_front(engine):
    for params in (SamplingParams(logprobs=10**6), SamplingParams(prompt_logprobs=21)):
        with pytest.raises(ValueError, match="max_logprobs"):
            engine.add_request("Hello", params)
    assert not engine.has_unfinished_requests()
    out = alone(engine, "Hello", SamplingParams(temperature=0, max_tokens=2, logprobs=20))
    assert len(out[0]) == 2


def test_client_ids_never_collide_with_internal_ids(engine, default_lm):
    tok = default_lm.tokenizer
    prompt_x, prompt_0x = DOC + "Question x?", DOC + "Another question entirely, 0_x?"
    sampled = SamplingParams(temperature=0, n=2, max_tokens=8, ignore_eos=True)
    ref_x = alone(engine, prompt_x, sampled)
    ref_0x = alone(engine, prompt_0x, GREEDY)
    ref_y = alone(engine, "y prompt", GREEDY)
    ref_y0 = alone(engine, "y-0 prompt", GREEDY)
    # "0_x" beside "x" with n=2 (whose sequences were once named "0_x", "1_x"); "y-0" beside "y"
    engine.add_request(prompt_x, sampled, request_id="x")
    engine.add_request(prompt_0x, GREEDY, request_id="0_x")
    engine.add_request("y prompt", GREEDY, request_id="y")
    engine.add_request("y-0 prompt", GREEDY, request_id="y-0")
    with pytest.raises(ValueError, match="already in use"):  # a duplicate live id changes nothing
        engine.add_request("intruder", GREEDY, request_id="x")
    done = run_all(engine)
    assert [c.token_ids for c in done["x"].outputs] == ref_x
    assert [c.token_ids for c in done["0_x"].outputs] == ref_0x
    assert [c.token_ids for c in done["y"].outputs] == ref_y
    assert [c.token_ids for c in done["y-0"].outputs] == ref_y0
    # a later innocent request on the popular prefix: right output, right cached tokens
    innocent_prompt = tok.encode(DOC + "Question x?")
    rid = engine.add_request(innocent_prompt, GREEDY)
    innocent = run_all(engine)[rid]
    assert innocent.outputs[0].token_ids == ref_x[0]
    assert innocent.num_cached_tokens == (len(innocent_prompt) - 1) // 16 * 16


def test_generated_ids_skip_ids_a_client_holds(engine):
    taken = engine.add_request("first", GREEDY)
    nxt = str(int(taken) + 1)
    engine.add_request("client", GREEDY, request_id=nxt)
    auto = engine.add_request("second", GREEDY)
    assert auto not in (taken, nxt)
    assert set(run_all(engine)) == {taken, nxt, auto}


class _ExplodingParams(SamplingParams):
    """A real SamplingParams subclass, as a user may pass, that fails when the sampler reads it:
    the one way to make sampling raise for one request without patching engine code."""

    @property
    def greedy(self) -> bool:
        raise RuntimeError("boom")


def test_one_requests_sampling_failure_fails_that_request_only(engine):
    ref = alone(engine, "The capital of France is", GREEDY)
    ref_seeded = alone(engine, "Tell me a story", SamplingParams(temperature=1.0, seed=5, max_tokens=8))
    good = engine.add_request("The capital of France is", GREEDY)
    seeded = engine.add_request("Tell me a story", SamplingParams(temperature=1.0, seed=5, max_tokens=8))
    bad = engine.add_request("Hello there", _ExplodingParams(temperature=1.0, max_tokens=8, n=2))
    done = run_all(engine)
    assert done[bad].finished and "boom" in done[bad].error
    assert all(c.finish_reason == "abort" for c in done[bad].outputs)
    assert done[good].error is None and [done[good].outputs[0].token_ids] == ref
    assert done[seeded].error is None and [done[seeded].outputs[0].token_ids] == ref_seeded
    assert engine.get_stats().num_requests_errored >= 1


def test_a_failing_forward_fails_the_batch_and_the_engine_keeps_serving(engine, monkeypatch):
    ref = alone(engine, DOC + "After the failure?", GREEDY)
    # The forward pass cannot be made to fail from the outside without breaking the model, so this
    # one test replaces it for a single call: it proves the batch is failed, not the engine.
    real = engine.runner.model.forward
    calls = {"n": 0}

    def failing_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device lost")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.runner.model, "forward", failing_once)
    rid = engine.add_request(DOC + "During the failure?", GREEDY)
    outs = engine.step()  # does not raise
    assert [o.request_id for o in outs] == [rid] and outs[0].finished and "device lost" in outs[0].error
    assert not engine.has_unfinished_requests()
    # the failed step's blocks hold no valid KV: nothing may hit them
    rid = engine.add_request(DOC + "After the failure?", GREEDY)
    after = run_all(engine)[rid]
    assert after.num_cached_tokens == 0 and [after.outputs[0].token_ids] == ref


def test_stats_snapshot_follows_every_change(engine):
    before = engine.get_stats()
    rid = engine.add_request(DOC + "stats?", GREEDY)
    added = engine.get_stats()
    assert added.num_waiting == 1 and added.num_prompt_tokens > before.num_prompt_tokens
    engine.step()
    stepped = engine.get_stats()
    assert (
        stepped.num_running == 1
        and stepped.kv_cache_usage > 0
        and stepped.num_generation_tokens == before.num_generation_tokens + 1
    )
    engine.abort_request(rid)
    aborted = engine.get_stats()
    assert aborted.num_running == 0 and aborted.kv_cache_usage == 0
    assert (aborted.num_blocks, aborted.block_size, aborted.max_model_len) == (engine.num_blocks, 16, 512)
    with pytest.raises(AttributeError):
        aborted.num_running = 3  # frozen: a reader on another thread never sees half an update


def test_kv_events_are_drained_into_a_bounded_buffer(default_lm, monkeypatch):
    from prefixkv.engine import llm_engine

    monkeypatch.setattr(llm_engine, "MAX_PENDING_KV_EVENTS", 8)
    engine = LLMEngine(
        EngineConfig(
            dtype="float32", device="cpu", num_blocks=24, block_size=4, max_model_len=96, enable_kv_cache_events=True
        ),
        loaded=default_lm,
    )
    for i in range(6):  # enough distinct prompts to store and evict far more than 8 events
        alone(engine, f"Prompt number {i} says something different about topic {i * 7}", GREEDY)
    assert len(engine._kv_events) <= 8  # the buffer never grows past its bound
    events = engine.take_kv_events()
    assert 0 < len(events) <= 8 and engine.get_stats().num_kv_events_dropped > 0
    assert engine.take_kv_events() == []
    alone(engine, "One more prompt after draining", GREEDY)
    assert engine.take_kv_events()  # new events arrive after a drain
