"""/metrics on a multi-tenant server (--require-cache-salt) tells no tenant what another sent (issue
36, item 9). /metrics is open without a key (as in vLLM), and the image encoder cache's counters
moved when a tenant sent an image another had sent. With --require-cache-salt: an API key puts
/metrics behind it; without one, /metrics stays open and leaves the per-item counters out. A real
server on a tiny LLaVA, a victim and a hostile tenant sending the victim's image."""

from __future__ import annotations

import httpx
import pytest

from ..server.conftest import Server
from .conftest import make_image
from .test_mm_chat import data_url, image_msg

pytestmark = pytest.mark.slow

KEY = "tenant-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _chat(server: Server, image, salt: str, headers=None) -> None:
    body = {"model": "llava", "messages": image_msg(data_url(image)), "max_tokens": 2, "cache_salt": salt}
    r = httpx.post(server.base + "/v1/chat/completions", json=body, headers=headers or {}, timeout=120)
    assert r.status_code == 200, r.text


def _server(llava, *extra: str) -> Server:
    return Server(llava[0], "--served-model-name", "llava", "--block-size", "8", "--require-cache-salt", *extra)


def test_open_metrics_leave_out_the_encoder_cache_counters(llava):
    server = _server(llava)
    try:
        victim = make_image(60)
        _chat(server, victim, "victim")
        _chat(server, victim, "hostile")  # the victim's image under another salt
        m = server.wait_idle()
        assert not [name for name in m if name.startswith("prefixkv:mm_encoder")]
        assert m["vllm:num_requests_running"] == 0  # /metrics itself stays open for probes and scrapes
    finally:
        server.stop()


def test_with_an_api_key_metrics_need_it(llava):
    server = _server(llava, "--api-key", KEY)
    try:
        assert httpx.get(server.base + "/metrics", timeout=10).status_code == 401
        assert httpx.get(server.base + "/health", timeout=10).status_code == 200
        victim = make_image(61)
        _chat(server, victim, "victim", AUTH)
        _chat(server, victim, "hostile", AUTH)
        r = httpx.get(server.base + "/metrics", headers=AUTH, timeout=10)
        assert r.status_code == 200
        hits = [line for line in r.text.splitlines() if line.startswith("prefixkv:mm_encoder_cache_hits_total")]
        runs = [line for line in r.text.splitlines() if line.startswith("prefixkv:mm_encoder_runs_total")]
        # the operator sees them; and the hostile tenant's request never hit the victim's entry
        assert len(hits) == 1 and float(hits[0].split()[-1]) == 0
        assert len(runs) == 1 and float(runs[0].split()[-1]) == 2
    finally:
        server.stop()
