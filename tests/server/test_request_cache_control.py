"""Cache control per request, on a real server: `pin` keeps a request's prompt cached after it
(bounded, refused with streaming), `cache_priority` orders which cached blocks the priority
eviction policy gives up first (test_cache_control.py checks that it is refused where no policy
reads it)."""

from __future__ import annotations

import pytest

from .conftest import API_NAME, HTTP, long_text

KEY = "cache-key"
# A small cache, so that a short flood runs through all of it: the prompts are sized in its blocks
# (~54 tokens, 3 full blocks of 16 and a partial one), and their prefill is this module's work.
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
        "--eviction-policy",
        "priority",
    )


def post(server, path, body, key=KEY):
    return HTTP.post(server.base + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def complete(server, prompt, **extra):
    r = post(
        server, "/v1/completions", {"model": API_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}
    )
    assert r.status_code == 200, r.text
    return r.json()


def flood(server, seed, **extra):
    for i in range(3):  # each ~54 tokens (4 blocks while it runs): together past the 8 blocks
        complete(server, long_text(seed + i, 50), **extra)


def test_pin_keeps_the_prompt_through_a_flood_and_is_bounded(server):
    prompt = long_text(7, 50)
    first = complete(server, prompt, pin=True)
    pinned = first["usage"]["prompt_tokens_details"]["pinned_tokens"]
    assert pinned == first["usage"]["prompt_tokens"] // 16 * 16 and pinned > 0
    unpinned = long_text(9, 30)
    assert complete(server, unpinned)["usage"]["prompt_tokens_details"]["pinned_tokens"] is None
    flood(server, 100)
    assert complete(server, unpinned)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the flood evicts
    again = complete(server, prompt)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= pinned - 16  # its last block is recomputed
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    r = post(server, "/v1/completions", {"model": API_NAME, "prompt": prompt, "pin": True, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "pin"
    huge = long_text(8, 30)  # more whole blocks than the bound has left (2 > 4 - 3)
    r = post(server, "/v1/completions", {"model": API_NAME, "prompt": huge, "max_tokens": 1, "pin": True})
    assert r.status_code == 400 and "--max-pinned-fraction" in r.json()["error"]["message"], r.text
    r = post(server, "/v1/cache/unpin", {"prompt": prompt})
    assert r.status_code == 200 and r.json()["unpinned_tokens"] == pinned
    assert server.wait_idle()["prefixkv:pinned_blocks"] == 0


@pytest.mark.parametrize("important", [True, False])
def test_cache_priority_orders_what_a_flood_evicts(server, important):
    doc = long_text(20 if important else 21, 50)
    first = complete(server, doc, cache_priority=-5 if important else 10)
    flood(server, 200 if important else 300, cache_priority=10 if important else -5)
    cached = complete(server, doc)["usage"]["prompt_tokens_details"]["cached_tokens"]
    if important:
        assert cached >= first["usage"]["prompt_tokens"] // 16 * 16 - 16
    else:
        assert cached == 0
    server.wait_idle()
