"""Speculative decoding (n-gram drafts) changes no output: greedy ones token for token (and
transformers' too), seeded draws token for token, stops, penalties, min_tokens and logprobs as
without drafts - whatever row of a verification step they fall on - and the cache keeps the right
rows of every block drafts wrote. Every block is free after each run (`run`)."""

from __future__ import annotations

from typing import Any

import pytest

from prefixkv import SamplingParams
from prefixkv.outputs import RequestOutput
from prefixkv.server.metrics import ServerMetrics

from ..conftest import hf_greedy
from .test_correctness import DOC, engine_for, run
from .test_correctness import finished_outputs as outputs

# every draft proposed: what the tests see does not hang on the machine's step times
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "by_measured_cost": False,
}
MAX_NEW = 24


def seen(out: RequestOutput) -> list[tuple[Any, ...]]:
    """What a client sees of each sequence, logprob values rounded (a verification step computes
    a row in a longer product than a decode step: the last bits differ)."""
    return [
        (
            tuple(c.token_ids),
            c.text,
            c.finish_reason,
            c.stop_reason,
            None if c.logprobs is None else [sorted(round(lp.logprob, 3) for lp in e.values()) for e in c.logprobs],
        )
        for c in out.outputs
    ]


@pytest.fixture(scope="module")
def doc_prompts(default_lm) -> list[list[int]]:
    tok = default_lm.tokenizer
    return [tok.encode(DOC + q) for q in ("Repeat the text above:", "What is kept?", "Summarize:")]


@pytest.fixture(scope="module")
def engines(default_lm):
    return engine_for(default_lm), engine_for(default_lm, speculative_config=SPEC)


def test_greedy_outputs_equal_without_drafts_and_transformers(engines, doc_prompts, hf_ref_model):
    plain, spec = engines
    before = spec.scheduler.spec_stats.num_draft_tokens
    base = run(plain, doc_prompts, MAX_NEW)
    assert run(spec, doc_prompts, MAX_NEW) == base
    stats = spec.scheduler.spec_stats
    drafted = stats.num_draft_tokens - before
    assert drafted and 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # kept and rejected drafts
    assert base[0] == hf_greedy(hf_ref_model, doc_prompts[0], MAX_NEW)


def test_stops_max_tokens_and_min_tokens_on_any_row(engines, doc_prompts):
    """A stop token, a stop string, max_tokens and min_tokens placed at every position of the
    output: some fall on a kept draft, some on the row after it."""
    plain, spec = engines
    prompt = doc_prompts[0]
    reference = outputs(plain, [prompt], [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)])[0]
    tokens, text = reference.outputs[0].token_ids, reference.outputs[0].text
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in range(1, MAX_NEW)]
    params += [SamplingParams(temperature=0, max_tokens=MAX_NEW, stop_token_ids=[t], ignore_eos=True) for t in tokens]
    cuts = sorted({text[a : a + 3] for a in range(1, len(text) - 3, 2) if text[a : a + 3].strip()})
    params += [SamplingParams(temperature=0, max_tokens=MAX_NEW, stop=[c], ignore_eos=True) for c in cuts]
    params += [
        SamplingParams(temperature=0, max_tokens=MAX_NEW, stop=[c], include_stop_str_in_output=True) for c in cuts[:6]
    ]
    # EOS counts from min_tokens on: the model's own EOS, and a stop token forced early
    params += [
        SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=m, stop_token_ids=[tokens[1]]) for m in range(0, 8)
    ]
    prompts = [prompt] * len(params)
    # the model ends its answer to this one at once: min_tokens holds EOS back up to a row
    params += [SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=m) for m in range(1, 12)]
    prompts += [doc_prompts[1]] * 11
    base = [seen(o) for o in outputs(plain, prompts, params)]
    assert [seen(o) for o in outputs(spec, prompts, params)] == base
    assert len({b[0][0] for b in base}) > 10  # the stops cut the output in many places


def test_penalties_and_logprobs_equal_without_drafts(engines, doc_prompts):
    plain, spec = engines
    """Row j of a verification counts the first j drafts as output (penalties read them); light
    penalties still let the model repeat the text, so drafts are kept under them."""
    plain, spec = engines
    params = [
        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, frequency_penalty=0.6, presence_penalty=0.3),
        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3),
    ]
    params += [
        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, frequency_penalty=f) for f in (0.1, 0.2)
    ]
    params += [
        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, presence_penalty=p) for p in (0.2, 0.4)
    ]
    prompts = [*doc_prompts, *[doc_prompts[0]] * 4]
    kept = spec.scheduler.spec_stats.num_accepted_tokens
    base = [seen(o) for o in outputs(plain, prompts, params)]
    assert [seen(o) for o in outputs(spec, prompts, params)] == base
    assert spec.scheduler.spec_stats.num_accepted_tokens > kept


def test_seeded_draws_equal_without_drafts(engines, doc_prompts):
    """The generator of a request that kept j drafts is set back to have drawn j + 1 uniforms: each
    kept token is the one a step without drafts draws."""
    plain, spec = engines
    params = [
        SamplingParams(temperature=0.7, top_p=0.95, seed=11, max_tokens=MAX_NEW, ignore_eos=True),
        SamplingParams(temperature=0.5, seed=3, n=2, max_tokens=MAX_NEW, ignore_eos=True),
        SamplingParams(temperature=0.3, top_k=5, seed=5, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1),
    ]
    kept = spec.scheduler.spec_stats.num_accepted_tokens
    base = [seen(o) for o in outputs(plain, doc_prompts, params)]
    assert [seen(o) for o in outputs(spec, doc_prompts, params)] == base
    assert spec.scheduler.spec_stats.num_accepted_tokens > kept  # drawn rows kept drafts


def test_blocks_written_by_drafts_hold_the_right_rows(default_lm, doc_prompts):
    """The next turn of a conversation hits the blocks of the answer, which verification steps
    wrote (rejected drafts' rows included, rewritten after): its output is the one computed from
    scratch."""
    spec = engine_for(default_lm, speculative_config=SPEC, block_size=4)
    plain = engine_for(default_lm, enable_prefix_caching=False, block_size=4)
    first = doc_prompts[1]
    answer = run(spec, [first], 32)[0]
    follow_up = [*first, *answer, *default_lm.tokenizer.encode(" Again:")]
    rid = spec.add_request(follow_up, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    got: list[RequestOutput] = []
    while spec.has_unfinished_requests():
        got += [o for o in spec.step() if o.finished and o.request_id == rid]
    assert got[0].num_cached_tokens >= len(first) + 28  # the answer's blocks were hits
    assert list(got[0].outputs[0].token_ids) == run(plain, [follow_up], MAX_NEW)[0]
    assert spec.kv_cache_manager.num_free_blocks == spec.num_blocks


def test_no_drafts_above_disable_by_batch_size(default_lm, doc_prompts):
    spec = engine_for(default_lm, speculative_config={**SPEC, "disable_by_batch_size": 2})
    run(spec, doc_prompts, 8)  # three running: no drafts
    assert spec.scheduler.spec_stats.num_drafts == 0
    run(spec, doc_prompts[:1], 16)
    assert spec.scheduler.spec_stats.num_drafts > 0


def test_metrics_count_drafts_as_vllm_names_them(engines, doc_prompts):
    _, spec = engines
    run(spec, doc_prompts[:1], 12)
    text = ServerMetrics(spec, "m").render().decode()
    stats = spec.get_stats()
    labels = 'engine="0",model_name="m"'
    drafted, kept = stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens
    assert f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {float(drafted)}" in text
    assert f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {float(kept)}" in text
    first = stats.spec_decode_accepted_per_position[0]
    assert f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="0"}} {float(first)}' in text
    assert kept == sum(stats.spec_decode_accepted_per_position) > 0


def test_refused_where_a_rejected_draft_would_stay(tmp_path, default_lm):
    from prefixkv.config import EngineConfig
    from prefixkv.engine.llm_engine import LLMEngine

    from .fuzz_caching import checkpoint

    model = checkpoint("mamba2", tmp_path)
    with pytest.raises(ValueError, match="speculative_config cannot be used with the recurrent"):
        LLMEngine(EngineConfig(model=str(model), device="cpu", num_blocks=8, speculative_config=SPEC))
    with pytest.raises(ValueError, match="speculative_config with async_scheduling=True"):
        engine_for(default_lm, speculative_config=SPEC, async_scheduling=True)


def test_each_verification_row_is_sampled_as_the_request_after_its_drafts():
    """Row j counts drafts 1..j as output: penalties see them, and min_tokens lets EOS through from
    the row where the output reaches it; rows whose sampling reads neither are the request itself."""
    from prefixkv.engine.model_runner import _verify_rows
    from prefixkv.engine.scheduler_output import ScheduledRequest

    def scheduled(rid: str, params: SamplingParams, drafts: tuple[int, ...]) -> ScheduledRequest:
        return ScheduledRequest(
            req_id=rid,
            token_ids=[9, *drafts],
            start=10,
            block_table=[0],
            sample=True,
            sampling_params=params,
            generator=None,
            prompt_token_ids=[1, 2],
            output_token_ids=[7, 9],
            block_eos=2 < params.min_tokens,
            draft_token_ids=drafts,
        )

    penalized = scheduled("p", SamplingParams(temperature=0, frequency_penalty=0.5), (4, 5, 6))
    held = scheduled("m", SamplingParams(temperature=0, min_tokens=4), (4, 5, 6))
    plain = scheduled("g", SamplingParams(temperature=0), (3,))
    prefill = ScheduledRequest("c", [1, 2, 3], 0, [1], False, plain.sampling_params, None, [1, 2, 3], [])
    rows, as_requests = _verify_rows([prefill, penalized, held, plain], [0, 3, 7, 11, 13], {})
    assert rows == [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert [r.output_token_ids for r in as_requests[:4]] == [[7, 9], [7, 9, 4], [7, 9, 4, 5], [7, 9, 4, 5, 6]]
    assert [r.block_eos for r in as_requests[4:8]] == [True, True, False, False]  # outputs 2, 3, 4, 5
    assert as_requests[8] is plain and as_requests[9] is plain


def test_streamed_deltas_carry_every_kept_token(engines, doc_prompts):
    """A step that kept drafts streams all its tokens at once; the deltas add up to the output
    a token at a time gives."""
    from prefixkv.sampling_params import RequestOutputKind

    plain, spec = engines
    final = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    expected = outputs(plain, doc_prompts[:1], [final])[0].outputs[0]
    delta = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    rid = spec.add_request(doc_prompts[0], delta)
    text, tokens, sizes = "", [], []
    while spec.has_unfinished_requests():
        for out in spec.step():
            if out.request_id == rid:
                text += out.outputs[0].text
                tokens += out.outputs[0].token_ids
                sizes.append(len(out.outputs[0].token_ids))
    assert (text, tokens) == (expected.text, list(expected.token_ids))
    assert max(sizes) > 1


def test_drafts_by_measured_cost_change_no_output(default_lm, doc_prompts):
    """The draft budget (on by default) gives drafts by the step times it measures: how many a
    step verifies varies, the outputs do not."""
    plain = engine_for(default_lm)
    budgeted = engine_for(default_lm, speculative_config={**SPEC, "by_measured_cost": True})
    params = [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)] * 3
    params.append(SamplingParams(temperature=0.6, seed=9, max_tokens=MAX_NEW, ignore_eos=True))
    prompts = [*doc_prompts, doc_prompts[0]]
    assert run(budgeted, prompts, params=params) == run(plain, prompts, params=params)
    budget = budgeted.scheduler.draft_budget
    assert budget is not None and budget._steps_timed > 0
    assert engine_for(default_lm, speculative_config=SPEC).scheduler.draft_budget is None
