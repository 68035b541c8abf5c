"""Serving options that change the process: an empty API key, --require-cache-salt, and a
graceful SIGTERM with requests in flight (the last test: it stops this module's server)."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.slow  # real server subprocesses: deselected by make test-fast


@pytest.fixture(scope="module")
def server(make_server):
    # 5 s to drain: the short request, in the engine before the signal, needs 4 decode steps; the
    # 900-token ones (>20 s alone) cannot finish. The drain's length is what the test costs: the
    # long requests decode all through it.
    return make_server("--api-key", "", "--require-cache-salt", "--shutdown-timeout", "5")


def test_empty_api_key_means_no_key(server):
    assert httpx.get(server.base + "/v1/models", timeout=10).status_code == 200


def test_require_cache_salt(server):
    body = {"prompt": "Hello there", "max_tokens": 2}
    r = httpx.post(server.base + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(server.base + "/v1/chat/completions", json=chat, timeout=60).status_code == 400
    r = httpx.post(server.base + "/v1/completions", json={**body, "cache_salt": "tenant-a"}, timeout=60)
    assert r.status_code == 200, r.text


def test_sigterm_drains_then_ends_what_is_left_and_exits_0(server):
    long = {"prompt": "Tell me a long story.", "max_tokens": 900, "ignore_eos": True, "cache_salt": "t"}
    short = {"prompt": "Say hi.", "max_tokens": 4, "ignore_eos": True, "cache_salt": "t"}
    results: dict = {"events": [], "done": False}

    def stream() -> None:
        with httpx.stream("POST", server.base + "/v1/completions", json={**long, "stream": True}, timeout=120) as r:
            results["stream_status"] = r.status_code
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    results["done"] = True
                elif line.startswith("data: "):
                    results["events"].append(json.loads(line[6:]))

    def plain(key: str, body: dict) -> None:
        results[key] = httpx.post(server.base + "/v1/completions", json=body, timeout=120)

    threads = [threading.Thread(target=stream), threading.Thread(target=plain, args=("long", long))]
    for t in threads:
        t.start()
    deadline = time.time() + 60
    while not results["events"] and time.time() < deadline:  # the stream is generating
        time.sleep(0.05)
    short_thread = threading.Thread(target=plain, args=("short", short))
    short_thread.start()
    # the signal comes once the short request is in the engine (a fixed wait lost the race on a
    # loaded machine: the short request came after the signal and was refused)
    deadline = time.time() + 60
    while time.time() < deadline:
        m = server.metrics()
        if m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] >= 3:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the three requests were not in the engine after 60 s: {m}")
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    # While requests are in flight the listener stays open: a new connection gets a 503 naming
    # the shutdown (a load balancer retries elsewhere), and /health says 503 so health checks take
    # the server out of rotation; it was "connection refused" from the signal on.
    late = httpx.post(server.base + "/v1/completions", json=short, timeout=10)
    assert late.status_code == 503 and "shutting down" in late.text, late.text
    assert late.headers.get("connection") == "close"
    health = httpx.get(server.base + "/health", timeout=10)
    assert health.status_code == 503 and "shutting down" in health.text
    for t in [*threads, short_thread]:
        t.join(90)
    assert server.proc.wait(60) == 0, server.output()
    assert results["short"].status_code == 200  # finished within the drain time
    assert len(results["short"].json()["choices"][0]["text"]) > 0
    assert results["long"].status_code == 503 and "shutting down" in results["long"].text
    assert results["stream_status"] == 200 and results["done"]
    errors = [e["error"] for e in results["events"] if "error" in e]
    texts = [e for e in results["events"] if "choices" in e]
    assert texts and len(errors) == 1 and errors[0]["code"] == 503, results["events"][-3:]
    assert "Event loop is closed" not in server.output()


def test_sigterm_on_an_idle_server_exits_at_once(make_server):
    """Nothing in flight: nothing to drain, the listener closes and the process exits promptly."""
    idle = make_server("--shutdown-timeout", "30")
    t0 = time.monotonic()
    idle.proc.send_signal(signal.SIGTERM)
    assert idle.proc.wait(20) == 0, idle.output()
    assert time.monotonic() - t0 < 10
    with pytest.raises(httpx.TransportError):
        httpx.get(idle.base + "/health", timeout=2)
