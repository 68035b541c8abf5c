"""Disconnects and a bounded load test against a real `prefixkv serve` (no API key)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from .conftest import long_text

pytestmark = pytest.mark.slow  # real server subprocesses: deselected by make test-fast

NUM_CLIENTS = 32
LOAD_TIMEOUT = 240.0  # hard bound on the whole load test


@pytest.fixture(scope="module")
def server(make_server):
    return make_server("--max-num-seqs", "64")


def test_stream_disconnect_aborts_and_frees_blocks(server):
    before = server.metrics()
    with httpx.Client(timeout=60) as c:
        with c.stream(
            "POST",
            server.base + "/v1/completions",
            json={"prompt": long_text(10, 40), "max_tokens": 400, "stream": True, "ignore_eos": True},
        ) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # keep the iterator: dropping it closes the connection
            seen = 0
            while seen < 2:
                line = next(lines)
                if line.startswith("data: ") and line != "data: [DONE]":
                    seen += 1
            during = server.metrics()
            assert during["vllm:kv_cache_usage_perc"] > 0
            assert during["vllm:num_requests_running"] == 1
    after = server.wait_idle(timeout=20)
    assert after["prefixkv:request_aborted_total"] - before.get("prefixkv:request_aborted_total", 0) == 1
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 400
    assert server.healthy()


def test_nonstream_disconnect_aborts(server):
    before = server.metrics()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.base + "/v1/completions",
            timeout=httpx.Timeout(60, read=1.5),
            json={"prompt": "Tell me a story.", "max_tokens": 600, "ignore_eos": True},
        )
    after = server.wait_idle(timeout=20)
    assert after["prefixkv:request_aborted_total"] - before.get("prefixkv:request_aborted_total", 0) == 1
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 600


def test_chat_stream_disconnect_via_openai_client(server):
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model="HuggingFaceTB/SmolLM2-135M-Instruct",
        stream=True,
        messages=[{"role": "user", "content": "Write a long poem."}],
        max_tokens=500,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i >= 2:
            break
    stream.close()
    server.wait_idle(timeout=20)


async def _client(http: httpx.AsyncClient, base: str, i: int, prompt: str, disconnect: bool) -> dict:
    body = {
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0.7,
        "seed": i,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    text, finish, usage, chunks = "", None, None, 0
    async with http.stream("POST", base + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                return {"i": i, "text": text, "finish": finish, "usage": usage, "done": True}
            obj = json.loads(data)
            assert "error" not in obj, obj
            if obj["choices"]:
                chunks += 1
                text += obj["choices"][0]["text"]
                finish = obj["choices"][0]["finish_reason"] or finish
            if obj.get("usage"):
                usage = obj["usage"]
            if disconnect and chunks >= 2:
                return {"i": i, "done": False}  # leaving the block closes the connection
    return {"i": i, "done": False, "truncated": True}


def test_bounded_load_with_early_disconnects(server):
    # two full blocks the even clients share: each admission caches them for the ones after it
    # (a longer prefix only adds prefill, the bulk of this test's CPU)
    prefix = long_text(20, 40)
    prompts = [prefix + f" Item number {i}:" if i % 2 == 0 else long_text(100 + i, 40) for i in range(NUM_CLIENTS)]
    disconnect = [i % 4 == 3 for i in range(NUM_CLIENTS)]
    before = server.metrics()

    async def run():
        limits = httpx.Limits(max_connections=NUM_CLIENTS + 4, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=httpx.Timeout(LOAD_TIMEOUT), limits=limits) as http:
            tasks = [_client(http, server.base, i, p, d) for i, (p, d) in enumerate(zip(prompts, disconnect))]

            # health stays responsive while the engine is busy
            async def probe():
                await asyncio.sleep(1.0)
                r = await http.get(server.base + "/health")
                return r.status_code

            return await asyncio.wait_for(asyncio.gather(probe(), *tasks), LOAD_TIMEOUT)

    t0 = time.time()
    health, *results = asyncio.run(run())
    elapsed = time.time() - t0
    assert health == 200
    completed = [r for r in results if r["done"]]
    assert len(completed) == NUM_CLIENTS - sum(disconnect), results
    for r in completed:
        assert r["finish"] == "length"
        assert r["usage"]["completion_tokens"] == 12
        assert r["text"]
    shared = [r for r in completed if r["i"] % 2 == 0]
    assert any(r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for r in shared)
    after = server.wait_idle(timeout=30)
    assert after["prefixkv:request_aborted_total"] - before.get("prefixkv:request_aborted_total", 0) <= sum(disconnect)
    finished = after["vllm:request_success_total"] - before.get("vllm:request_success_total", 0)
    assert finished >= len(completed)
    assert server.healthy()
    assert elapsed < LOAD_TIMEOUT
    # and it still serves normally afterwards
    r = httpx.post(server.base + "/v1/completions", json={"prompt": "After the storm", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
