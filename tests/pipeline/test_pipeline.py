"""A two-stage pipeline (prefixkv.pipeline): stage 1 generates with its hidden states on its own
engine, a head consumes them, stage 2 embeds stage 1's answers on another engine; each stage equals
running it alone, and each stage's own prefix cache serves what repeats."""

from __future__ import annotations

import pytest
import torch

from prefixkv import SamplingParams
from prefixkv.llm import LLM
from prefixkv.pipeline import HeadStage, LLMStage, Pipeline
from prefixkv.stage_outputs import PoolingParams

from ..stage_outputs.test_engine_stage import DOC, engine_for

QUESTIONS = ["What is kept?", "Who benefits? Answer:"]
ANSWER = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_two_stages_and_a_head(default_lm):
    thinker = LLMStage(
        "thinker", LLM.from_engine(engine_for(default_lm)), sampling_params=ANSWER, return_hidden_states=True
    )
    torch.manual_seed(0)
    probe = torch.nn.Linear(default_lm.config.hidden_size, 2)
    head = HeadStage("probe", lambda h: probe(h.float()))
    critic_llm = LLM.from_engine(engine_for(default_lm))
    critic = LLMStage("critic", critic_llm, task="embed", pooling_params=PoolingParams("mean"))
    instruction = "Rate how helpful this answer is, considering clarity, accuracy and tone in detail. Answer: "
    pipe = Pipeline([thinker, head, critic], connectors={"critic": lambda out: instruction + out.text})
    prompts = [DOC + q for q in QUESTIONS]
    stage1, probes, critiques = pipe.run(prompts)

    alone = LLM.from_engine(engine_for(default_lm)).generate(prompts, ANSWER, use_tqdm=False)
    for out, ref, p in zip(stage1, alone, probes):
        assert out.token_ids == list(ref.outputs[0].token_ids) and out.text == ref.outputs[0].text
        assert out.hidden_states.shape == (len(out.all_token_ids) - 1, default_lm.config.hidden_size)
        assert p.data.shape == (len(out.all_token_ids) - 1, 2)
        torch.testing.assert_close(p.data, probe(out.hidden_states.float()))
    assert stage1[1].num_cached_tokens > 0  # the shared document, from the thinker's own cache
    ref_emb = LLM.from_engine(engine_for(default_lm)).embed(
        [instruction + o.text for o in stage1], pooling="mean", use_tqdm=False
    )
    for c, r in zip(critiques, ref_emb):
        torch.testing.assert_close(c.data, torch.tensor(r.outputs.embedding), atol=1e-5, rtol=1e-4)
    assert critiques[1].num_cached_tokens > 0  # the critic's instruction, from the critic's own cache
    for stage in (thinker, critic):
        engine = stage.llm.llm_engine
        assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


def test_refusals(default_lm):
    llm = LLM.from_engine(engine_for(default_lm))
    with pytest.raises(ValueError, match="first stage"):
        Pipeline([HeadStage("h", lambda h: h)])
    with pytest.raises(ValueError, match="unique"):
        Pipeline([LLMStage("a", llm), LLMStage("a", llm)])
    with pytest.raises(ValueError, match="pooling_params"):
        LLMStage("e", llm, task="embed", sampling_params=ANSWER)
    with pytest.raises(ValueError, match="hidden states"):
        Pipeline([LLMStage("a", llm, sampling_params=ANSWER), HeadStage("h", lambda h: h)]).run(["hi"])
