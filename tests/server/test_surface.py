"""vLLM's drop-in surface against a real `prefixkv serve`: honest streaming, binding before the
load, the extra routes (/tokenize, /detokenize, /ping, /v1/models/{id}, /reset_prefix_cache in
dev mode), and the request fields vLLM users rely on. One server for the module."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from .conftest import long_text

pytestmark = pytest.mark.slow

KEY = "surface-key"
KEY2 = "second-key"
NAME = "smol"


@pytest.fixture(scope="module")
def server(make_server):
    # Small steps make the prefill of a long prompt span many engine steps (the streaming test).
    return make_server(
        "--served-model-name",
        NAME,
        "--api-key",
        KEY,
        "--api-key",
        KEY2,
        "--max-num-batched-tokens",
        "32",
        env={"VLLM_SERVER_DEV_MODE": "1"},
    )


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, timeout=120, max_retries=0)


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_chat_role_chunk_comes_after_the_first_token(server):
    """The assistant-role chunk is sent once the first token exists (vLLM), not before the prefill:
    when it arrives, the engine has already counted the whole prompt and a generated token."""
    before = server.metrics()
    body = {
        "model": NAME,
        "messages": [{"role": "user", "content": long_text(7, 450)}],
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", server.base + "/v1/chat/completions", json=body, headers=auth(), timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(json.loads(line[6:]) for line in lines if line.startswith("data: "))
        at_first = server.metrics()  # read while the stream is still open
        rest = [line for line in lines if line.startswith("data: ")]
    assert first["choices"][0]["delta"]["role"] == "assistant"
    prompt_tokens = at_first["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
    usage = json.loads(rest[-2][6:])["usage"]
    assert usage["prompt_tokens"] > 400  # many steps of 32 tokens
    assert prompt_tokens == usage["prompt_tokens"]  # the whole chunked prefill was done ...
    assert at_first["vllm:generation_tokens_total"] > before["vllm:generation_tokens_total"]  # ... and a token made
    assert rest[-1] == "data: [DONE]"
    server.wait_idle()
