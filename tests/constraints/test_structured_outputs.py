"""Structured outputs offline, on the embedded SmolLM2 (byte-level BPE, 49,152 tokens): a JSON
schema output validates with `jsonschema`, regex and choice outputs match, each of n sequences
walks its own grammar, the request ends when the grammar does, a preempted request resumes its
grammar where it was, and bad specs are refused by name."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from prefixkv import LLM, SamplingParams
from prefixkv.config import EngineConfig
from prefixkv.engine.llm_engine import LLMEngine
from prefixkv.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "enum": ["France", "Germany", "Italy"]},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["city", "country", "population_millions"],
}
QUESTION = [
    {"role": "user", "content": "What is the capital of France? Answer in JSON with city, country and population."}
]


def json_params(**kw) -> SamplingParams:
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    return SamplingParams(temperature=0, max_tokens=40, structured_outputs=so, **kw)


@pytest.fixture(scope="module")
def json_answer(constrained_llm):
    return constrained_llm.chat(QUESTION, json_params(), use_tqdm=False)[0].outputs[0]


def test_json_schema_output_validates_and_ends_with_the_grammar(json_answer):
    jsonschema.validate(json.loads(json_answer.text), SCHEMA)
    assert json_answer.finish_reason == "stop" and len(json_answer.token_ids) < 40


def test_regex_and_choice_outputs_match(constrained_llm):
    regex = r" [A-Z][a-z]+, [A-Z][a-z]+\."
    so = StructuredOutputsParams(regex=regex)
    out = constrained_llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=12, structured_outputs=so), use_tqdm=False
    )[0].outputs[0]
    assert re.fullmatch(regex, out.text) and out.finish_reason == "stop", out.text
    # sampled, n=3: every sequence has its own matcher
    choices = ["yes", "no", "maybe not"]
    so = StructuredOutputsParams(choice=choices)
    outs = constrained_llm.chat(
        [{"role": "user", "content": "Is Paris in France?"}],
        SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=6, structured_outputs=so),
        use_tqdm=False,
    )[0].outputs
    assert len(outs) == 3 and all(o.text in choices and o.finish_reason == "stop" for o in outs), outs


def test_preempted_request_resumes_its_grammar(default_lm, json_answer):
    # 7 blocks of 16 tokens: two of these requests cannot both grow to the end, one is preempted
    engine = LLMEngine(
        EngineConfig(dtype="float32", device="cpu", num_blocks=7, block_size=16, max_model_len=112), loaded=default_lm
    )
    llm = LLM.from_engine(engine)
    outs = llm.chat([QUESTION, QUESTION], json_params(), use_tqdm=False)
    assert engine.get_stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [json_answer.token_ids] * 2
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


@pytest.mark.parametrize(
    "so, match",
    [
        (dict(json={"type": "no-such-type"}), "invalid structured outputs JSON schema: .*no-such-type"),
        (dict(regex="a(b"), "invalid structured outputs regex: .*parenthesis"),
        (dict(grammar="root ::= undefined_rule"), "invalid structured outputs grammar: .*undefined_rule"),
    ],
)
def test_invalid_specs_are_a_value_error_naming_the_problem(constrained_llm, so, match):
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**so))
    with pytest.raises(ValueError, match=match):
        constrained_llm.generate("x", params, use_tqdm=False)
    assert not constrained_llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(json=SCHEMA, regex="a"), "exactly one of"),
        (dict(), "exactly one of"),
        (dict(json="{not json"), "not valid JSON"),
        (dict(choice=[]), "choice must be a non-empty list"),
        (dict(regex="a", whitespace_pattern=" "), "whitespace_pattern is not supported"),
        (dict(structural_tag="{}"), "structural_tag is not supported"),
        (dict(choice=[str(i) for i in range(1025)]), "1025 options; at most 1024"),
        (dict(choice=["x" * 40000, "y" * 40000]), "80000 characters long; at most 65536"),
        (dict(grammar="root ::= " + '"a" | ' * 20000 + '"b"'), "at most 65536"),
        (dict(json={"enum": ["v" * 70000]}), "at most 65536"),
    ],
)
def test_malformed_params_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**kwargs)


def test_refused_combinations(constrained_llm):
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": SCHEMA})
    with pytest.raises(ValueError, match="min_tokens cannot be combined with structured_outputs"):
        constrained_llm.generate("x", json_params(min_tokens=2), use_tqdm=False)


def test_grammars_run_ahead_under_async_scheduling(default_lm, constrained_llm, json_answer):
    """Steps scheduled ahead fill each grammar's mask after the token in flight (accepted for the
    mask, rolled back, booked a step later): JSON, regex and sampled choice outputs (n=3, each
    sequence its own matcher, the grammar ending while the next step runs) equal the in-order
    engine's, and every block is free after."""
    engine = LLMEngine(
        EngineConfig(
            dtype="float32", device="cpu", num_blocks=96, block_size=16, max_model_len=1024, async_scheduling=True
        ),
        loaded=default_lm,
    )
    engine.runner.constraint_masks = True  # as on a GPU: one bitmask a step
    ahead = LLM.from_engine(engine)
    assert ahead.chat(QUESTION, json_params(), use_tqdm=False)[0].outputs[0].token_ids == json_answer.token_ids
    assert engine.num_steps_ahead > 0
    regex = SamplingParams(
        temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex=r" [A-Z]\w+, [A-Z]\w+\.")
    )
    choice = SamplingParams(
        temperature=1.0,
        seed=5,
        n=3,
        max_tokens=6,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe not"]),
    )
    for prompt, params in (("The capital of France is", regex), ("Is Paris in France? Answer:", choice)):
        want = constrained_llm.generate(prompt, params, use_tqdm=False)[0].outputs
        got = ahead.generate(prompt, params, use_tqdm=False)[0].outputs
        assert [(o.token_ids, o.text, o.finish_reason) for o in got] == [
            (o.token_ids, o.text, o.finish_reason) for o in want
        ]
        assert all(o.finish_reason == "stop" for o in got)
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
