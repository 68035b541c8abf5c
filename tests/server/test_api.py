"""The OpenAI-compatible API against a real `prefixkv serve`, driven by the official openai client."""

from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import API_KEY, HTTP, long_text
from .conftest import API_NAME as NAME


@pytest.fixture(scope="module")
def server(api_server):  # shared with test_surface.py (conftest.py)
    return api_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def llm():
    from prefixkv import LLM

    return LLM(kv_cache_memory_bytes=64 << 20, max_model_len=1024)


def greedy(**kw):
    from prefixkv import SamplingParams

    return SamplingParams(temperature=0.0, **kw)


def test_models(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [NAME, "smol"]


def test_completion_matches_llm_generate(client, llm):
    prompt = "The three primary colors are"
    res = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
    ref = llm.generate(prompt, greedy(max_tokens=12), use_tqdm=False)[0]
    choice = res.choices[0]
    assert choice.text == ref.outputs[0].text
    assert choice.finish_reason == ref.outputs[0].finish_reason == "length"
    assert res.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert res.usage.completion_tokens == 12
    assert res.usage.total_tokens == res.usage.prompt_tokens + 12
    assert res.object == "text_completion" and res.id.startswith("cmpl-") and res.model == NAME


def test_completion_stream_equals_nonstream(client):
    prompt = "A short list of fruits:"
    full = client.completions.create(model="smol", prompt=prompt, max_tokens=10, temperature=0)
    chunks = list(
        client.completions.create(
            model="smol",
            prompt=prompt,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].model == NAME  # as vLLM: the first served name


def test_chat_matches_llm_chat(client, llm):
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a planet."}]
    res = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
    ref = llm.chat(messages, greedy(max_tokens=12), use_tqdm=False)[0]
    assert res.choices[0].message.content == ref.outputs[0].text
    assert res.choices[0].message.role == "assistant"
    assert res.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert res.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert res.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert res.object == "chat.completion"


def test_chat_stream(client):
    messages = [{"role": "user", "content": "Say hello."}]
    full = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=NAME,
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens
    # without include_usage no chunk carries usage
    plain = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=4, stream=True))
    assert all(c.usage is None for c in plain)


def test_stream_interval_gathers_tokens_per_chunk(client):
    """vLLM's `stream_interval`: the first tokens at once, then a chunk per 4 tokens, the same text."""
    messages = [{"role": "user", "content": "Count from one to twenty."}]
    kw = dict(model=NAME, messages=messages, max_tokens=13, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    chunks = [
        c
        for c in client.chat.completions.create(
            **{**kw, "extra_body": {"ignore_eos": True, "stream_interval": 4, "return_token_ids": True}}, stream=True
        )
        if c.choices and c.choices[0].model_extra.get("token_ids")
    ]
    assert [len(c.choices[0].model_extra["token_ids"]) for c in chunks] == [1, 4, 4, 4]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="stream_interval"):
        client.chat.completions.create(**{**kw, "extra_body": {"stream_interval": 0}}, stream=True)


def test_repetition_detection_ends_a_loop(client):
    """vLLM's `repetition_detection`: finish_reason "repetition", stop_reason "repetition_detected"."""
    prompt = "one two one two one two one two one two one two"
    rd = {"max_pattern_size": 4, "min_count": 3}
    kw = dict(model=NAME, prompt=prompt, max_tokens=40, temperature=0)
    plain = client.completions.create(**kw, extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]
    cut = client.completions.create(
        **kw, extra_body={"ignore_eos": True, "return_token_ids": True, "repetition_detection": rd}
    ).choices[0]
    assert (cut.finish_reason, cut.model_extra["stop_reason"]) == ("repetition", "repetition_detected")
    ids = cut.model_extra["token_ids"]
    assert len(ids) < 40 and plain.model_extra["token_ids"][: len(ids)] == ids and plain.text.startswith(cut.text)
    with pytest.raises(openai.BadRequestError, match="min_count"):
        client.completions.create(**kw, extra_body={"repetition_detection": {"max_pattern_size": 4, "min_count": 1}})


def test_chat_default_max_tokens_is_rest_of_context(client):
    res = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Count: 1 2 3"}], temperature=0, extra_body={"stop": ["4"]}
    )
    assert res.choices[0].finish_reason in ("stop", "length")


def test_prefix_cache_hit_and_metrics(client, server):
    prefix = long_text(1, 100)  # six full blocks
    before = server.metrics()
    a = client.completions.create(model=NAME, prompt=prefix + " Question one?", max_tokens=4, temperature=0)
    b = client.completions.create(model=NAME, prompt=prefix + " Another question?", max_tokens=4, temperature=0)
    after = server.metrics()
    assert a.usage.prompt_tokens > 100
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    cached = b.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached >= a.usage.prompt_tokens - 32
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    assert d["vllm:prefix_cache_queries_total"] == a.usage.prompt_tokens + b.usage.prompt_tokens
    assert d["vllm:prefix_cache_hits_total"] == cached
    assert d["vllm:prompt_tokens_total"] == a.usage.prompt_tokens + b.usage.prompt_tokens
    assert d["vllm:generation_tokens_total"] == 8
    assert d["vllm:time_to_first_token_seconds_count"] == 2
    assert d["vllm:e2e_request_latency_seconds_count"] == 2
    assert d["vllm:request_success_total"] == 2
    assert 0 < after["prefixkv:prefix_cache_hit_rate"] <= 1
    assert after["vllm:kv_cache_usage_perc"] == 0
    # adaptive CPU threads (the default): back on the configured count once idle
    assert after["prefixkv:cpu_threads"] >= 1 and after["prefixkv:cpu_foreign_load"] >= 0
    assert after["prefixkv:cpu_steps_adapted_total"] >= 0
    assert after["prefixkv:cpu_steps_probed_total"] >= 0 and after["prefixkv:cpu_steps_row_split_total"] >= 0
    # chat over a long shared system prompt hits too
    sys_msg = {"role": "system", "content": long_text(2, 100)}
    c1 = client.chat.completions.create(
        model=NAME, max_tokens=4, temperature=0, messages=[sys_msg, {"role": "user", "content": "Hi"}]
    )
    c2 = client.chat.completions.create(
        model=NAME, max_tokens=4, temperature=0, messages=[sys_msg, {"role": "user", "content": "Hello there"}]
    )
    assert c1.usage.prompt_tokens_details.cached_tokens == 0
    assert c2.usage.prompt_tokens_details.cached_tokens >= c1.usage.prompt_tokens - 32  # all but the user turn


def test_cache_salt_isolates_tenants(client):
    prompt = long_text(5, 40)  # two full blocks

    def cached(salt):
        body = {"cache_salt": salt} if salt is not None else {}
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=1, temperature=0, extra_body=body)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # same prompt, other tenant: no hit
    assert cached(None) == 0  # unsalted is its own namespace
    assert cached("tenant-a") > 0  # same tenant: hit
    assert cached("tenant-b") > 0


def test_sampling_extras_n_logprobs_stop(client):
    r = client.completions.create(
        model=NAME,
        prompt="Once upon a time",
        max_tokens=6,
        n=2,
        temperature=0.8,
        seed=7,
        extra_body={"top_k": 20, "min_p": 0.05},
        logprobs=2,
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    for c in r.choices:
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == 6
        assert all(len(t) >= 2 for t in c.logprobs.top_logprobs)
    assert r.usage.completion_tokens == 12
    again = client.completions.create(
        model=NAME,
        prompt="Once upon a time",
        max_tokens=6,
        n=2,
        temperature=0.8,
        seed=7,
        extra_body={"top_k": 20, "min_p": 0.05},
    )
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded: reproducible
    s = client.completions.create(
        model=NAME, prompt="The capital of France is", max_tokens=12, temperature=0, stop=["."]
    )
    assert s.choices[0].finish_reason == "stop" and "." not in s.choices[0].text
    # stop_token_ids: stop on whatever greedy produces first
    first = client.completions.create(model=NAME, prompt="1, 2, 3,", max_tokens=1, temperature=0, logprobs=0)
    tok_text = first.choices[0].logprobs.tokens[0]
    assert tok_text
    ask = dict(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0)
    chat = client.chat.completions.create(**ask, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    as_ids = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    by_id = client.chat.completions.create(**ask, logprobs=True, top_logprobs=2, extra_body=as_ids)
    by_id = by_id.model_dump()["choices"][0]
    assert [c["token"] for c in by_id["logprobs"]["content"]] == [f"token_id:{t}" for t in by_id["token_ids"]]
    # the same tokens' logprobs (the second prefill reads cached blocks: equal up to float rounding)
    assert [c["logprob"] for c in by_id["logprobs"]["content"]] == pytest.approx([c.logprob for c in content], abs=1e-3)


def test_prompt_logprobs_and_echo_logprobs(client, server, llm):
    """vLLM's `prompt_logprobs` extra: the same values LLM.generate returns (the request reads
    nothing from the prefix cache, which would skip the positions it needs)."""
    prompt = "Prompt logprobs score every token of: the quick brown fox"
    ref = llm.generate(prompt, greedy(max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0]
    res = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    got = res.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ref.prompt_token_ids)
    for pos in range(1, len(got)):
        want = ref.prompt_logprobs[pos]
        assert {int(t) for t in got[pos]} == set(want)
        for t, lp in got[pos].items():
            assert lp["logprob"] == pytest.approx(want[int(t)].logprob, abs=1e-5)
            assert lp["rank"] == want[int(t)].rank and lp["decoded_token"] == want[int(t)].decoded_token
    assert res.usage.prompt_tokens_details.cached_tokens == 0
    # OpenAI's echo + logprobs: the prompt's tokens come first, the first without a logprob
    echo = client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=1)
    lp = echo.choices[0].logprobs
    n = len(ref.prompt_token_ids)
    assert echo.choices[0].text.startswith(prompt) and len(lp.tokens) == n + 2
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx(
        [ref.prompt_logprobs[i][t].logprob for i, t in enumerate(ref.prompt_token_ids) if i], abs=1e-5
    )
    assert lp.text_offset == sorted(lp.text_offset)
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 3
    h = {"Authorization": f"Bearer {API_KEY}"}
    url = server.base + "/v1/completions"
    _assert_error(
        server, HTTP.post(url, json={"prompt": "x", "prompt_logprobs": 21}, headers=h), 400, "prompt_logprobs"
    )
    # streamed: the first chunk carries them; echo + logprobs streams the same tokens and offsets
    chunks = list(
        client.completions.create(
            model=NAME, prompt=prompt, max_tokens=2, temperature=0, stream=True, extra_body={"prompt_logprobs": 2}
        )
    )
    assert chunks[0].choices[0].model_extra["prompt_logprobs"] == got
    assert all(c.choices[0].model_extra.get("prompt_logprobs") is None for c in chunks[1:] if c.choices)
    streamed = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=1, stream=True
    )
    parts = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert sum((p.tokens for p in parts), []) == lp.tokens
    assert sum((p.text_offset for p in parts), []) == lp.text_offset
    streamed_lps = [x for p in parts for x in p.token_logprobs]
    assert streamed_lps[0] is None
    assert streamed_lps[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    chat_url = server.base + "/v1/chat/completions"
    _assert_error(
        server,
        HTTP.post(
            chat_url,
            json={"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1, "stream": True},
            headers=h,
        ),
        400,
        "streaming chat",
    )
    assert server.wait_idle()["vllm:kv_cache_usage_perc"] == 0


def test_stop_token_ids(client, llm):
    tok = llm.get_tokenizer()
    prompt = "The capital of France is"
    ids = llm.generate(prompt, greedy(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids
    r = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=8, temperature=0, extra_body={"stop_token_ids": [ids[1]]}
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].stop_reason == ids[1]
    assert r.choices[0].text == tok.decode(ids[:1])


def test_token_id_prompt_and_batch(client):
    r = client.completions.create(model=NAME, prompt=[[504, 3575, 282, 4649, 314]], max_tokens=3, temperature=0)
    assert r.usage.prompt_tokens == 5
    batch = client.completions.create(model=NAME, prompt=["Hello", "Goodbye"], max_tokens=3, temperature=0)
    assert sorted(c.index for c in batch.choices) == [0, 1]
    single = client.completions.create(model=NAME, prompt="Goodbye", max_tokens=3, temperature=0)
    assert [c.text for c in batch.choices if c.index == 1] == [single.choices[0].text]


def _assert_error(server, resp: httpx.Response, status: int, needle: str = "") -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["code"] == status and err["message"] and err["type"]
    assert needle.lower() in err["message"].lower()
    assert server.healthy()


def test_errors_are_openai_shaped_and_server_survives(server, client):
    h = {"Authorization": f"Bearer {API_KEY}"}
    url = server.base + "/v1/completions"
    _assert_error(
        server,
        HTTP.post(url, content=b'{"prompt": "x", ', headers={**h, "content-type": "application/json"}),
        400,
        "json",
    )
    _assert_error(server, HTTP.post(url, json={"model": "nope", "prompt": "x"}, headers=h), 404, "nope")
    _assert_error(server, HTTP.post(url, json={"prompt": "x", "temperature": -1}, headers=h), 400, "temperature")
    _assert_error(server, HTTP.post(url, json={"prompt": "x", "temperature": "hot"}, headers=h), 400, "temperature")
    _assert_error(server, HTTP.post(url, json={"prompt": "x", "top_p": 0}, headers=h), 400, "top_p")
    _assert_error(server, HTTP.post(url, json={"prompt": "x", "max_tokens": 0}, headers=h), 400, "max_tokens")
    _assert_error(server, HTTP.post(url, json={"prompt": "word " * 1100}, headers=h), 400, "context length")
    _assert_error(server, HTTP.post(url, json={"prompt": "x", "max_tokens": 1024}, headers=h), 400, "context length")
    _assert_error(server, HTTP.post(url, json={"prompt": [10**9]}, headers=h), 400, "vocabulary")
    _assert_error(server, HTTP.post(url, json={}, headers=h), 400, "prompt")
    chat = server.base + "/v1/chat/completions"
    _assert_error(server, HTTP.post(chat, json={"messages": "hi"}, headers=h), 400)
    _assert_error(
        server,
        HTTP.post(chat, json={"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, headers=h),
        404,
    )
    # the official client maps them to its exception classes
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt="x", temperature=-0.5)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "word " * 1100}])
    # streaming errors are reported before the stream starts
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt="x", temperature=-1, stream=True)
    ok = client.completions.create(model=NAME, prompt="Still", max_tokens=2)
    assert ok.choices[0].text is not None
    m = server.metrics()
    assert m["prefixkv:http_request_errors_total"] >= 12
    assert m["vllm:kv_cache_usage_perc"] == 0


def test_api_key(server):
    url = server.base + "/v1/completions"
    _assert_error(server, HTTP.post(url, json={"prompt": "x", "max_tokens": 1}), 401)
    _assert_error(server, HTTP.post(url, json={"prompt": "x"}, headers={"Authorization": "Bearer wrong"}), 401)
    _assert_error(server, HTTP.get(server.base + "/v1/models"), 401)
    bad = openai.OpenAI(base_url=server.base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    # probes and scrapers stay open, as in vLLM; the OpenAPI docs do not
    for path in ("/metrics", "/health", "/ping", "/version"):
        assert HTTP.get(server.base + path).status_code == 200, path
    for path in ("/docs", "/redoc", "/openapi.json"):
        _assert_error(server, HTTP.get(server.base + path), 401)
        assert HTTP.get(server.base + path, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200


def test_reset_prefix_cache(client, server):
    prompt = long_text(4, 40)  # two full blocks
    client.completions.create(model=NAME, prompt=prompt, max_tokens=2)
    hit = client.completions.create(model=NAME, prompt=prompt, max_tokens=2)
    assert hit.usage.prompt_tokens_details.cached_tokens > 0
    # flushing every tenant's cache is an admin action: behind the key
    _assert_error(server, HTTP.post(server.base + "/reset_prefix_cache"), 401)
    r = HTTP.post(server.base + "/reset_prefix_cache", headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200 and r.json()["success"] is True
    miss = client.completions.create(model=NAME, prompt=prompt, max_tokens=2)
    assert miss.usage.prompt_tokens_details.cached_tokens == 0


def test_metrics_names(server):
    text = HTTP.get(server.base + "/metrics").text
    for name in [
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_per_output_token_seconds_bucket",
        "vllm:request_success_total",
    ]:
        assert f"\n{name}{{" in text, name
    assert 'model_name="HuggingFaceTB/SmolLM2-135M-Instruct"' in text
