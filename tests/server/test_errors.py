"""Error plumbing of the app in-process: an unexpected exception in a route is an OpenAI-shaped
500, counted in prefixkv:http_request_errors_total, and the app keeps serving."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient


@pytest.fixture(scope="module")
def app():
    from prefixkv.config import EngineConfig
    from prefixkv.engine.llm_engine import LLMEngine
    from prefixkv.server.app import create_app

    app = create_app(LLMEngine(EngineConfig(kv_cache_memory_bytes=16 << 20, max_model_len=256)))

    @app.get("/v1/boom")
    async def boom():  # stands for any bug in a route
        raise RuntimeError("a bug")

    return app


def test_unexpected_error_is_a_counted_openai_500(app):
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.get("/v1/boom")
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["code"] == 500 and err["type"] == "InternalServerError" and "RuntimeError" in err["message"]
        assert "a bug" not in err["message"]  # details go to the log, not to clients
        metrics = client.get("/metrics").text
        assert 'prefixkv:http_request_errors_total{engine="0",model_name=' in metrics
        assert 'status="500"} 1.0' in metrics
        r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_reset_prefix_cache_only_in_dev_mode(app):
    """As vLLM: the admin route exists only with VLLM_SERVER_DEV_MODE=1 (this app is not in dev mode)."""
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.post("/reset_prefix_cache").status_code == 404
