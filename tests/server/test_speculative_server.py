"""`prefixkv serve --speculative-config` driven by the openai client: the text is the offline
engine's without drafts, streamed or not (a chunk may carry several tokens), vLLM's spec_decode
counters move, and the server is idle with every block free after."""

from __future__ import annotations

import json

import openai
import pytest

from prefixkv import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPT = "The sensor pairs with the display when both are on and close. " * 8 + "Repeat the sentence above:"


@pytest.fixture(scope="module")
def server(make_server):
    return make_server("--speculative-config", json.dumps({**SPEC, "by_measured_cost": False}))


def test_outputs_equal_the_engine_without_drafts(server):
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="-", timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0)
    pieces = client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0, stream=True)
    streamed = "".join(chunk.choices[0].text for chunk in pieces if chunk.choices)
    expected = LLM(model=None).generate(PROMPT, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    assert whole.choices[0].text == streamed == expected[0].outputs[0].text
    metrics = server.wait_idle()
    assert metrics["vllm:spec_decode_num_accepted_tokens_total"] > 0
    assert metrics["vllm:spec_decode_num_draft_tokens_total"] >= metrics["vllm:spec_decode_num_accepted_tokens_total"]
