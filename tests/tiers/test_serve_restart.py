"""Warm restart: a `prefixkv serve` subprocess restarted against the same disk tier serves the
first request of a known prefix from it."""

from __future__ import annotations

import httpx
import pytest

from ..server.conftest import Server
from .test_engine_tiers import prompts


def complete(server: Server, ids: list[int]) -> dict:
    body = {"model": server.model, "prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = httpx.post(server.base + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow
def test_restarted_server_hits_its_disk_tier(tiny_model, tmp_path):
    ids = prompts(3, 1)[0]
    flags = (tiny_model, "--block-size", "4", "--kv-tier", f"disk:{tmp_path / 'kv'}", "--dtype", "float32")
    first = Server(*flags)
    try:
        first.model = httpx.get(first.base + "/v1/models").json()["data"][0]["id"]
        cold = complete(first, ids)
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        first.stop()  # SIGTERM: the engine loop ends and the queued saves are flushed
    second = Server(*flags)
    try:
        second.model = first.model
        warm = complete(second, ids)
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 36
        m = second.wait_idle()
        assert m["vllm:external_prefix_cache_hits_total"] == 36
        assert m["prefixkv:kv_tier_hits_total"] == 9 and m["prefixkv:kv_tier_errors_total"] == 0
    finally:
        second.stop()
