"""`prefixkv serve --async-scheduling` driven by the openai client: completions and chat, streamed
and not, equal the in-order engine's (`LLM.generate`), stops seen a step late end where they
should, concurrent streams with client disconnects leave every block free."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from .conftest import long_text

pytestmark = pytest.mark.slow  # a real server subprocess: deselected by make test-fast

NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(make_server):
    return make_server("--async-scheduling", "--max-num-seqs", "16")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def llm():
    from prefixkv import LLM

    return LLM(kv_cache_memory_bytes=128 << 20, max_model_len=1024)


def test_one_at_a_time_equals_the_in_order_engine(server, client, llm):
    """Greedy completions alone on the server (batch 1, as the reference): text, tokens and finish
    reason equal `LLM.generate`'s; a stop string and a stop token end where they end in order."""
    from prefixkv import SamplingParams

    prompt = "The three primary colors are"
    ref = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    res = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0)
    assert res.choices[0].text == ref.text and res.choices[0].finish_reason == ref.finish_reason
    stop = ref.text[5:9]
    ref_stop = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, stop=[stop]), use_tqdm=False)[0]
    got = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
    assert got.choices[0].text == ref_stop.outputs[0].text and got.choices[0].finish_reason == "stop"
    stop_id = ref.token_ids[6]
    ref_tok = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_id]), use_tqdm=False
    )[0].outputs[0]
    streamed = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=16, temperature=0, stream=True, extra_body={"stop_token_ids": [stop_id]}
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref_tok.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0, seed=3)
    ref_chat = llm.chat(messages, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert chat.choices[0].message.content == ref_chat.text
    metrics = server.wait_idle(timeout=20)
    assert metrics["vllm:kv_cache_usage_perc"] == 0


async def _stream(http: httpx.AsyncClient, base: str, i: int, disconnect: bool) -> tuple[int, str | None]:
    body = {"model": NAME, "prompt": long_text(i, 40), "max_tokens": 8 + 4 * i, "stream": True, "temperature": 0}
    tokens, reason = 0, None
    async with http.stream("POST", base + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            tokens += 1
            if disconnect and tokens >= 3:
                return tokens, "disconnected"
            if '"finish_reason":"' in line.replace(" ", ""):
                reason = line.split('"finish_reason":')[1].split('"')[1]
    return tokens, reason


def test_concurrent_streams_and_disconnects_free_every_block(server):
    """Twelve concurrent streams, every third dropped by its client after three chunks: the
    others finish with "length" (or "stop" at an EOS), and the server ends idle, no block held."""

    async def main() -> list[tuple[int, str | None]]:
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(_stream(http, server.base, i, i % 3 == 0) for i in range(12)))

    results = asyncio.run(asyncio.wait_for(main(), timeout=200))
    for i, (tokens, reason) in enumerate(results):
        if i % 3 == 0:
            assert reason == "disconnected"
        else:
            assert reason in ("length", "stop") and tokens >= 1, (i, tokens, reason)
    metrics = server.wait_idle(timeout=30)
    assert metrics["vllm:kv_cache_usage_perc"] == 0
    assert metrics["prefixkv:steps_scheduled_ahead_total"] > 20  # the decode steps did run ahead
    assert server.healthy()
