"""POST /v1/cache/pin and /v1/cache/unpin on a real server, driven by the openai client and httpx:
a pinned system prompt survives a flood, a tenant cannot unpin another's, the bound is named,
the residency metrics parse and move; `cache_priority` is refused where no eviction policy reads
it (this server's default one)."""

from __future__ import annotations

import pytest
from openai import OpenAI

from .conftest import API_NAME, HTTP, long_text

KEY = "pin-key"
# A small cache, so that a short flood runs through all of it: the prompts are sized in its blocks
# (~50 tokens, 3 full blocks of 16), and their prefill is this module's work.
BLOCKS = 8


@pytest.fixture(scope="module")
def server(make_server):
    return make_server(
        "--api-key",
        KEY,
        "--num-gpu-blocks-override",
        str(BLOCKS),
        "--max-model-len",
        str(BLOCKS * 16),
        "--max-pinned-fraction",
        "0.5",
        "--kv-cache-metrics",
        "--kv-cache-metrics-sample",
        "1.0",
    )


def post(server, path, body, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return HTTP.post(server.base + path, json=body, headers=headers, timeout=120)


def test_a_pinned_system_prompt_survives_a_flood(server):
    system = {"role": "system", "content": long_text(1, 45)}
    assert post(server, "/v1/cache/pin", {"messages": [system]}, key=None).status_code == 401
    r = post(server, "/v1/cache/pin", {"messages": [system]})
    assert r.status_code == 200, r.text
    pinned = r.json()["pinned_tokens"]
    assert pinned >= 3 * 16
    client = OpenAI(base_url=server.base + "/v1", api_key=KEY)
    for i in range(3):  # each ~54 tokens (4 blocks while it runs): together past the 8 blocks
        client.completions.create(model=API_NAME, prompt=long_text(100 + i, 50), max_tokens=2, temperature=0)
    chat = client.chat.completions.create(
        model=API_NAME, max_tokens=4, temperature=0, messages=[system, {"role": "user", "content": "Hi"}]
    )
    assert chat.usage.prompt_tokens_details.cached_tokens >= pinned
    m = server.metrics()
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert m["prefixkv:pinned_blocks"] == pinned // 16 and m["prefixkv:pinned_prefixes"] == 1
    assert m["vllm:kv_cache_usage_perc"] == pytest.approx(pinned // 16 / BLOCKS)  # pinned blocks are held
    assert m["vllm:kv_block_lifetime_seconds_count"] > 0  # the flood's blocks were evicted and measured
    assert m["prefixkv:kv_block_evictions_total"] > 0
    # another tenant (salt) reaches no pin; the owner unpins
    assert post(server, "/v1/cache/unpin", {"messages": [system], "cache_salt": "other"}).status_code == 404
    r = post(server, "/v1/cache/unpin", {"messages": [system]})
    assert r.status_code == 200 and r.json()["unpinned_tokens"] == pinned
    assert server.wait_idle()["prefixkv:pinned_blocks"] == 0  # every block free again


def test_bad_pins_are_refused_by_name(server):
    too_long = {"prompt": long_text(7, 75)}  # ~5 blocks: past half of 8
    r = post(server, "/v1/cache/pin", too_long)
    assert r.status_code == 400 and "max-pinned-fraction" in r.json()["error"]["message"]
    assert post(server, "/v1/cache/pin", {}).status_code == 400
    assert (
        post(server, "/v1/cache/pin", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}).status_code
        == 400
    )
    assert post(server, "/v1/cache/pin", {"prompt": [10**9]}).status_code == 400
    assert post(server, "/v1/cache/pin", {"prompt": "hello", "model": "nope"}).status_code == 404
    assert post(server, "/v1/cache/pin", {"prompt": "hello", "temperature": 1}).status_code in (400, 422)
    server.wait_idle()


def test_cache_priority_is_refused_where_no_policy_reads_it(server):
    # the policy that reads it, --eviction-policy priority, is test_request_cache_control.py's
    body = {"model": API_NAME, "prompt": "x", "max_tokens": 1, "cache_priority": 3}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400 and "cache_priority" in r.json()["error"]["message"], r.text
