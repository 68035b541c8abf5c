"""Random JSON bodies shaped like the request schema against a real server: never a 5xx, the
server keeps serving, and no KV block is held afterwards."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


@pytest.fixture(scope="module")
def server(make_server):
    return make_server("--max-n", "4", "--max-prompts-per-request", "3")


scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
    st.sampled_from([0, 1, 2, -1, 20, 21, 2 ** 63, 2 ** 64 - 1, 2 ** 64]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20), st.sampled_from(["\ud800", "", "<|im_end|>", "\x00"]),
)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=6)
prompts = st.one_of(st.text(max_size=40), st.lists(st.integers(-5, 60000), max_size=8),
                    st.lists(st.text(max_size=20), max_size=3), st.lists(st.lists(st.integers(0, 500), max_size=5),
                                                                          max_size=3), values)
SAMPLING = ["n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos", "include_stop_str_in_output",
            "skip_special_tokens", "cache_salt", "request_id", "prompt_logprobs", "stream", "stream_options",
            "user", "model", "response_format", "tools", "unknown_field"]
field_values = st.dictionaries(st.sampled_from(SAMPLING), values, max_size=5)
contents = st.one_of(st.text(max_size=30), values,
                     st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", 3]),
                                                     "text": values}), max_size=2))
messages = st.one_of(values, st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x", 5]),
                                                             "content": contents}), max_size=3))


def _bounded(body: dict, length_keys: tuple[str, ...]) -> dict:
    """Keep valid requests cheap: lengths that would be accepted are made small (invalid ones
    stay as they are, to be refused)."""
    for key in length_keys:
        v = body.get(key)
        if v is None:  # None means "the rest of the context": up to a thousand tokens
            body[key] = 3
        elif isinstance(v, int) and not isinstance(v, bool) and v > 4:
            body[key] = 4
    body.setdefault("model", None)
    if body["model"] is None:
        del body["model"]
    return body


def _check(server, path: str, body: dict) -> None:
    try:
        content = json.dumps(body)
    except (ValueError, TypeError):
        return
    with httpx.stream("POST", server.base + path, content=content, headers={"Content-Type": "application/json"},
                      timeout=120) as r:
        text = "".join(r.iter_text())
    assert r.status_code < 500, (r.status_code, text[:500], content[:500])
    for line in text.splitlines():  # a streamed response's error event: never an internal error
        if line.startswith("data: {") and '"error"' in line:
            assert json.loads(line[6:])["error"]["code"] < 500, (line, content[:500])


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(fields=field_values, prompt=prompts, max_tokens=values, logprobs=values, echo=st.booleans())
def test_fuzz_completions(server, fields, prompt, max_tokens, logprobs, echo):
    body = {**fields, "prompt": prompt, "max_tokens": max_tokens, "logprobs": logprobs, "echo": echo}
    _check(server, "/v1/completions", _bounded(body, ("max_tokens",)))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(fields=field_values, msgs=messages, max_tokens=values, top_logprobs=values, logprobs=values)
def test_fuzz_chat(server, fields, msgs, max_tokens, top_logprobs, logprobs):
    body = {**fields, "messages": msgs, "max_completion_tokens": max_tokens, "top_logprobs": top_logprobs,
            "logprobs": logprobs}
    _check(server, "/v1/chat/completions", _bounded(body, ("max_completion_tokens",)))


def test_after_fuzzing_nothing_is_held(server):
    assert server.healthy()
    server.wait_idle()
    r = httpx.post(server.base + "/v1/completions", json={"prompt": "Still here?", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200
