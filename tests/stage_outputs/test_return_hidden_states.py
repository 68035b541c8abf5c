"""SamplingParams(return_hidden_states=True): the final hidden state of every computed position of a
generated sequence (prompt, then output but the last token), equal to transformers' on the same
tokens, equal with and without prefix hits and the stage-output cache, never doubled by a
preemption."""

from __future__ import annotations

import pytest
import torch

from prefixkv import SamplingParams
from prefixkv.llm import LLM

from .test_engine_stage import DOC, QUESTIONS, engine_for, hf_hidden

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, return_hidden_states=True)


def _check(out, hf_ref_model):
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    h = out.hidden_states
    assert h.shape == (len(ids) - 1, hf_ref_model.config.hidden_size)
    torch.testing.assert_close(h.float(), hf_hidden(hf_ref_model, ids[:-1]), atol=3e-4, rtol=1e-3)


def test_every_position_equals_transformers_with_and_without_hits(default_lm, hf_ref_model):
    prompts = [default_lm.tokenizer.encode(DOC + q) for q in QUESTIONS[:2]]
    for stage_cache in (True, False):
        llm = LLM.from_engine(engine_for(default_lm, enable_stage_output_cache=stage_cache))
        first = llm.generate([{"prompt_token_ids": prompts[0]}], PARAMS, use_tqdm=False)[0]
        second = llm.generate([{"prompt_token_ids": prompts[1]}], PARAMS, use_tqdm=False)[0]
        # the stage cache serves the shared prefix's rows; without it the prompt is recomputed
        assert (second.num_cached_tokens > 0) == stage_cache
        for out in (first, second):
            _check(out, hf_ref_model)
        plain = llm.generate(
            [{"prompt_token_ids": prompts[1]}],
            SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
            use_tqdm=False,
        )[0]
        assert plain.hidden_states is None and plain.outputs[0].token_ids == second.outputs[0].token_ids
        engine = llm.llm_engine
        assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


def test_preemption_never_doubles_rows(default_lm, hf_ref_model):
    first = default_lm.tokenizer.encode(DOC + QUESTIONS[0])
    two = [first, default_lm.tokenizer.encode("An unrelated prompt about gardens and rain. " * 30)[: len(first)]]
    per_prompt = -(-max(len(p) for p in two) // 8)
    engine = engine_for(default_lm, num_blocks=2 * per_prompt + 1, block_size=8, max_model_len=8 * per_prompt + 20)
    llm = LLM.from_engine(engine)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, return_hidden_states=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in two], params, use_tqdm=False)
    assert engine.scheduler.num_preemptions > 0
    for out in outs:
        _check(out, hf_ref_model)


def test_refusals():
    with pytest.raises(ValueError, match="n=1"):
        SamplingParams(n=2, return_hidden_states=True)
    with pytest.raises(ValueError, match="return_hidden_states"):
        SamplingParams(return_hidden_states=1)
