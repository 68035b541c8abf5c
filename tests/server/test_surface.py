"""vLLM's drop-in surface against a real `prefixkv serve`: honest streaming, binding before the
load, the extra routes (/tokenize, /detokenize, /ping, /v1/models/{id}, /reset_prefix_cache in
dev mode), and the request fields vLLM users rely on. One server for the module."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from .conftest import API_KEY, API_KEY2, HTTP, long_text

pytestmark = pytest.mark.slow

KEY, KEY2 = API_KEY, API_KEY2
NAME = "smol"


@pytest.fixture(scope="module")
def server(api_server):  # the server test_api.py uses too (conftest.py): no start-up of its own
    return api_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, timeout=120, max_retries=0)


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_chat_role_chunk_comes_after_the_first_token(server):
    """The assistant-role chunk is sent once the first token exists (vLLM), not before the prefill:
    when it arrives, the engine has already counted the whole prompt and a generated token.
    The prompt's prefill (~1 s of engine time, more under load) is the window in which a role chunk
    sent early would be seen: the metrics read right after it takes ~10 ms."""
    before = server.metrics()
    body = {
        "model": NAME,
        "messages": [{"role": "user", "content": long_text(7, 330)}],
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with HTTP.stream("POST", server.base + "/v1/chat/completions", json=body, headers=auth(), timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(json.loads(line[6:]) for line in lines if line.startswith("data: "))
        at_first = server.metrics()  # read while the stream is still open
        rest = [line for line in lines if line.startswith("data: ")]
    assert first["choices"][0]["delta"]["role"] == "assistant"
    prompt_tokens = at_first["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
    usage = json.loads(rest[-2][6:])["usage"]
    assert usage["prompt_tokens"] > 350  # a prefill of hundreds of tokens
    assert prompt_tokens == usage["prompt_tokens"]  # the whole chunked prefill was done ...
    assert at_first["vllm:generation_tokens_total"] > before["vllm:generation_tokens_total"]  # ... and a token made
    assert rest[-1] == "data: [DONE]"
    server.wait_idle()


def post(server, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    return HTTP.post(server.base + path, json=body, headers=auth(key) if key else {}, timeout=120)


def test_tokenize_detokenize_as_vllm(server, client):
    text = "The quick brown fox jumps over the lazy dog. Ünïcödé ✓"
    r = post(server, "/tokenize", {"model": NAME, "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    tok = r.json()
    assert set(tok) == {"count", "max_model_len", "tokens", "token_strs"}
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) and tok["max_model_len"] == 1024
    assert client.completions.create(model=NAME, prompt=text, max_tokens=1).usage.prompt_tokens == tok["count"]
    assert post(server, "/detokenize", {"model": NAME, "tokens": tok["tokens"]}).json() == {"prompt": text}
    plain = post(server, "/tokenize", {"prompt": text}).json()  # model is optional; token_strs only when asked
    assert plain["tokens"] == tok["tokens"] and plain["token_strs"] is None

    # the chat form: the very tokens a chat request prefills
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    chat = post(server, "/tokenize", {"model": NAME, "messages": messages}).json()
    res = client.chat.completions.create(model=NAME, messages=messages, max_tokens=1)
    assert res.usage.prompt_tokens == chat["count"]
    bare = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert bare["tokens"] == chat["tokens"][: bare["count"]] and bare["count"] < chat["count"]
    prefill = messages + [{"role": "assistant", "content": "The color is"}]
    cont = post(
        server, "/tokenize", {"messages": prefill, "continue_final_message": True, "add_generation_prompt": False}
    )
    said = post(server, "/detokenize", {"tokens": cont.json()["tokens"]}).json()["prompt"]
    assert said.endswith("assistant\nThe color is")  # open-ended: no end of turn after it

    # refusals: by name, 404 for an unknown model, ids outside the vocabulary
    r = post(server, "/tokenize", {"prompt": "x", "tools": [{"type": "function"}]})
    assert r.status_code == 400 and "tools" in r.json()["error"]["message"]
    assert post(server, "/tokenize", {"model": "nope", "prompt": "x"}).status_code == 404
    r = post(server, "/detokenize", {"tokens": [1, 10**9]})
    assert r.status_code == 400 and "out of range" in r.json()["error"]["message"]
    assert post(server, "/tokenize", {"prompt": "x"}, key=None).status_code == 401  # behind the key
    assert post(server, "/detokenize", {"tokens": [1]}, key=KEY2).status_code == 200  # any --api-key works


def test_ping_models_by_id_and_reset(server, client):
    assert HTTP.post(server.base + "/ping", timeout=10).status_code == 200  # POST too, and open
    assert HTTP.get(server.base + "/ping", timeout=10).status_code == 200
    card = client.models.retrieve(NAME)
    assert card.id == NAME and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    # dev mode (VLLM_SERVER_DEV_MODE=1): the admin route exists, behind the key
    assert post(server, "/reset_prefix_cache", {}, key=None).status_code == 401
    r = post(server, "/reset_prefix_cache?reset_running_requests=true", {})
    assert r.status_code == 400 and "reset_running_requests" in r.json()["error"]["message"]
    server.wait_idle()
    assert post(server, "/reset_prefix_cache", {}, key=KEY2).status_code == 200


def test_request_fields_for_effect(server, client):
    text = long_text(3, 40)
    full = post(server, "/tokenize", {"prompt": text}).json()["tokens"]
    extra = {"truncate_prompt_tokens": 8, "return_token_ids": True}
    res = client.completions.create(model=NAME, prompt=text, max_tokens=4, temperature=0, extra_body=extra)
    choice = res.model_dump()["choices"][0]
    assert res.usage.prompt_tokens == 8 and choice["prompt_token_ids"] == full[-8:]  # the last 8 kept
    assert len(choice["token_ids"]) == 4
    assert post(server, "/detokenize", {"tokens": choice["token_ids"]}).json()["prompt"] == choice["text"]
    for side, kept in (("right", full[:8]), ("left", full[-8:])):  # vLLM's truncation_side
        res = client.completions.create(
            model=NAME, prompt=text, max_tokens=1, temperature=0, extra_body={**extra, "truncation_side": side}
        )
        assert res.model_dump()["choices"][0]["prompt_token_ids"] == kept, side
    r = post(server, "/v1/completions", {"prompt": text, "max_tokens": 1, **extra, "truncation_side": "middle"})
    assert r.status_code == 400 and "truncation_side" in r.text

    # chat: return_token_ids, streamed and not; the same greedy tokens
    msgs = [{"role": "user", "content": "Count to five."}]
    body = dict(model=NAME, messages=msgs, max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
    res = client.chat.completions.create(**body).model_dump()
    assert res["prompt_token_ids"] == post(server, "/tokenize", {"messages": msgs}).json()["tokens"]
    ids = res["choices"][0]["token_ids"]
    assert len(ids) == 6 and post(server, "/detokenize", {"tokens": ids}).json()["prompt"].startswith(
        res["choices"][0]["message"]["content"]
    )
    chunks = [c.model_dump() for c in client.chat.completions.create(**body, stream=True)]
    assert chunks[0]["prompt_token_ids"] == res["prompt_token_ids"]  # on the role chunk, as vLLM
    assert [t for c in chunks for ch in c["choices"] for t in (ch.get("token_ids") or [])] == ids
    cut = client.chat.completions.create(**{**body, "extra_body": {"truncate_prompt_tokens": 5}})
    assert cut.usage.prompt_tokens == 5

    # continue_final_message: the reply continues the assistant's text; add_generation_prompt=False
    prefill = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "The capital is"}]
    res = client.chat.completions.create(
        model=NAME,
        messages=prefill,
        max_tokens=3,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False, "return_token_ids": True},
    ).model_dump()
    said = post(server, "/detokenize", {"tokens": res["prompt_token_ids"]}).json()["prompt"]
    assert said.endswith("<|im_start|>assistant\nThe capital is")
    # vLLM's chat echo: the continued message's text first, streamed in its own chunk after the role
    go_on = {"continue_final_message": True, "add_generation_prompt": False, "echo": True}
    body_echo = dict(model=NAME, messages=prefill, max_tokens=3, temperature=0, extra_body=go_on)
    echoed = client.chat.completions.create(**body_echo).choices[0].message.content
    assert echoed == "The capital is" + res["choices"][0]["message"]["content"]
    chunks = [c.model_dump() for c in client.chat.completions.create(**body_echo, stream=True)]
    texts = [ch["delta"].get("content") for c in chunks for ch in c["choices"]]
    assert texts[:2] == ["", "The capital is"] and "".join(t or "" for t in texts) == echoed
    fresh = client.chat.completions.create(model=NAME, messages=prefill[:1], max_tokens=2, temperature=0)
    fresh_echo = client.chat.completions.create(
        model=NAME, messages=prefill[:1], max_tokens=2, temperature=0, extra_body={"echo": True}
    )
    assert fresh_echo.choices[0].message.content == fresh.choices[0].message.content  # a user turn: nothing echoed
    both = post(
        server,
        "/v1/chat/completions",
        {"messages": prefill, "continue_final_message": True, "add_generation_prompt": True},
    )
    assert both.status_code == 400 and "continue_final_message" in both.json()["error"]["message"]
    no_gen = client.chat.completions.create(
        model=NAME, messages=msgs, max_tokens=1, extra_body={"add_generation_prompt": False}
    )
    assert no_gen.usage.prompt_tokens < post(server, "/tokenize", {"messages": msgs}).json()["count"]

    # a per-request template with its kwargs
    tpl = "{{ prefix }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    res = client.chat.completions.create(
        model=NAME,
        messages=msgs,
        max_tokens=1,
        extra_body={"chat_template": tpl, "chat_template_kwargs": {"prefix": "Q: "}, "return_token_ids": True},
    ).model_dump()
    assert res["prompt_token_ids"] == post(server, "/tokenize", {"prompt": "Q: Count to five."}).json()["tokens"]

    # still refused, by name
    for field, value in (("early_stopping", True), ("truncate_prompt_tokens", 0)):
        r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1, field: value})
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    server.wait_idle()


def test_inter_token_latency_counts_every_token_after_the_first_streamed_or_not(server, client):
    """The engine books the latencies (not the outputs the routes read): a non-streamed request,
    which asks the engine for its final output only, counts as a streamed one does."""
    server.wait_idle()
    before = server.metrics()["vllm:inter_token_latency_seconds_count"]
    out = client.completions.create(
        model=NAME, prompt="Once upon", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 6
    after_plain = server.wait_idle()["vllm:inter_token_latency_seconds_count"]
    assert after_plain - before == 5
    stream = client.completions.create(
        model=NAME, prompt="Once upon", max_tokens=6, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == out.choices[0].text
    assert server.wait_idle()["vllm:inter_token_latency_seconds_count"] - after_plain == 5


def test_metrics_with_vllm_032_names_and_the_stats_line(server):
    """Runs last: the requests above are in the histograms, and the periodic line was logged."""
    m = server.metrics()
    for name in (
        "vllm:inter_token_latency_seconds_count",
        "vllm:request_time_per_output_token_seconds_count",
        "vllm:time_per_output_token_seconds_count",  # the old name, kept as an alias
        "vllm:request_prefill_time_seconds_count",
        "vllm:request_decode_time_seconds_count",
        "vllm:iteration_tokens_total_count",
    ):
        assert m.get(name, 0) > 0, name
    assert m["vllm:request_time_per_output_token_seconds_count"] == m["vllm:time_per_output_token_seconds_count"]
    # no step computed more than --max-num-batched-tokens (2048)
    assert m["vllm:iteration_tokens_total_sum"] <= 2048 * m["vllm:iteration_tokens_total_count"]
    text = HTTP.get(server.base + "/metrics", timeout=10).text
    info = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    assert 'block_size="16"' in info and 'enable_prefix_caching="True"' in info and info.endswith(" 1.0")
    log = server.output()
    assert "Avg prompt throughput:" in log and "Prefix cache hit rate:" in log
