"""The llguidance grammar backend (installed with prefixkv; xgrammar is the `xgrammar` extra):
greedy structured outputs equal xgrammar's where both accept the same language (a JSON schema
without free whitespace, xgrammar's strict mode written out; a regex, a choice, a GBNF grammar) -
the text, and the tokens where xgrammar's mask allows every token that spells a valid continuation
(in a JSON property name xgrammar takes "m", "illion", "s" where llguidance allows "mill"), bad
specs are refused by name, and a request for xgrammar without it installed is refused naming the extra."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from prefixkv import LLM, SamplingParams
from prefixkv.config import EngineConfig
from prefixkv.constraints import grammar as grammar_module
from prefixkv.engine.llm_engine import LLMEngine
from prefixkv.sampling_params import StructuredOutputsParams

from .test_structured_outputs import QUESTION, SCHEMA, json_params


@pytest.fixture(scope="module")
def guidance_llm(default_lm):
    config = EngineConfig(
        dtype="float32",
        device="cpu",
        num_blocks=96,
        block_size=16,
        max_model_len=1024,
        structured_outputs_backend="guidance",
    )
    return LLM.from_engine(LLMEngine(config, loaded=default_lm))


@pytest.fixture(autouse=True)
def guidance_nothing_left_behind(guidance_llm):
    yield
    engine = guidance_llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


def _both(constrained_llm, guidance_llm, prompt, params, chat=False):
    assert constrained_llm.llm_engine.input_processor.grammar_engine.backend == "xgrammar"
    assert guidance_llm.llm_engine.input_processor.grammar_engine.backend == "guidance"
    run = (
        (lambda llm: llm.chat(prompt, params, use_tqdm=False))
        if chat
        else (lambda llm: llm.generate(prompt, params, use_tqdm=False))
    )
    return run(constrained_llm)[0].outputs[0], run(guidance_llm)[0].outputs[0]


def test_json_schema_equals_xgrammar(constrained_llm, guidance_llm):
    x, g = _both(constrained_llm, guidance_llm, QUESTION, json_params(), chat=True)
    jsonschema.validate(json.loads(g.text), SCHEMA)
    assert g.text == x.text and g.finish_reason == x.finish_reason == "stop", (g.text, x.text)


@pytest.mark.parametrize(
    "so",
    [
        dict(regex=r" [A-Z][a-z]+, [A-Z][a-z]+\."),
        dict(choice=["Paris", "Lyon", 'Nice "quoted"']),
        dict(grammar='root ::= " " city ", " country "."\ncity ::= [A-Z] [a-z]+\ncountry ::= "France" | "Italy"'),
    ],
)
def test_regex_choice_grammar_equal_xgrammar(constrained_llm, guidance_llm, so):
    params = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(**so))
    x, g = _both(constrained_llm, guidance_llm, "The capital of France is", params)
    assert g.token_ids == x.token_ids and g.finish_reason == "stop", (g.text, x.text)
    if "regex" in so:
        assert re.fullmatch(so["regex"], g.text)


def test_json_object(guidance_llm):
    so = StructuredOutputsParams(json_object=True)
    out = guidance_llm.chat(
        QUESTION, SamplingParams(temperature=0, max_tokens=60, structured_outputs=so), use_tqdm=False
    )[0].outputs[0]
    assert isinstance(json.loads(out.text), dict) and out.finish_reason == "stop", out.text


@pytest.mark.parametrize(
    "so, match",
    [
        (dict(json={"type": "no-such-type"}), "(?s)invalid structured outputs JSON schema: .*no-such-type"),
        (dict(regex="a(b"), "(?s)invalid structured outputs regex: .*unclosed group"),
        (dict(grammar="root ::= undefined_rule"), "(?s)invalid structured outputs grammar: .*undefined_rule"),
    ],
)
def test_invalid_specs_are_a_value_error_naming_the_problem(guidance_llm, so, match):
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**so))
    with pytest.raises(ValueError, match=match):
        guidance_llm.generate("x", params, use_tqdm=False)


def test_backend_choice(monkeypatch, default_lm):
    with pytest.raises(ValueError, match="unknown structured outputs backend 'outlines'"):
        grammar_module.choose_backend("outlines")
    assert grammar_module.choose_backend("auto") == "xgrammar"  # the test extra installs it
    real = grammar_module.importlib.util.find_spec
    monkeypatch.setattr(grammar_module.importlib.util, "find_spec", lambda n, *a: None if n == "xgrammar" else real(n))
    assert grammar_module.choose_backend("auto") == "guidance"
    config = EngineConfig(dtype="float32", device="cpu", num_blocks=8, structured_outputs_backend="xgrammar")
    with pytest.raises(ImportError, match=r"pip install 'prefixkv\[xgrammar\]'"):
        LLMEngine(config, loaded=default_lm)


def test_properties_come_in_the_order_the_schema_declares(constrained_llm, guidance_llm):
    """A schema's properties are emitted in its own order, not sorted (what a reasoning field
    declared before its answer relies on), with both backends; the same schema in two orders is
    two grammars, and one in two spellings of its text one."""
    schema = {
        "type": "object",
        "properties": {
            "zone": {"type": "string", "enum": ["north", "south"]},
            "answer": {"type": "string", "maxLength": 12},
            "id": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["zone", "answer", "id"],
    }
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=so)
    for out in _both(constrained_llm, guidance_llm, QUESTION, params, chat=True):
        assert list(json.loads(out.text)) == ["zone", "answer", "id"], out.text
    flipped = {**schema, "properties": dict(reversed(list(schema["properties"].items())))}
    assert StructuredOutputsParams(json=flipped).key() != StructuredOutputsParams(json=schema).key()
    assert (
        StructuredOutputsParams(json=json.dumps(schema, indent=2)).key() == StructuredOutputsParams(json=schema).key()
    )
