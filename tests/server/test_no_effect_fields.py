"""Fields the openai SDK and agent frameworks send whose effect does not apply to a local engine
(store, metadata, service_tier, safety_identifier, user, prompt_cache_key; vLLM's return_token_offsets,
which it reads only on /render endpoints) are accepted - same
output as without them - and logged once each; a wrong type is still a 400 naming the field;
reasoning_effort and documents reach the chat template (as vLLM passes them); verbosity is refused by
name."""

from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import API_KEY

pytestmark = pytest.mark.slow
NAME = "smol"
FIELDS = dict(
    store=True,
    metadata={"team": "search"},
    service_tier="auto",
    safety_identifier="user-42",
    user="user-42",
    prompt_cache_key="support-bot",
)


@pytest.fixture(scope="module")
def server(api_server):
    return api_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, timeout=120, max_retries=0)


def post(server, path, body):
    return httpx.post(server.base + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)


def test_fields_without_effect_are_accepted_unchanged_and_logged_once(server, client):
    msgs = [{"role": "user", "content": "Name three colours."}]
    plain = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=8, temperature=0)
    for _ in range(2):
        res = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=8, temperature=0, **FIELDS)
        assert res.choices[0].message.content == plain.choices[0].message.content
    done = client.completions.create(model=NAME, prompt="One, two,", max_tokens=4, temperature=0, extra_body=FIELDS)
    assert (
        done.choices[0].text
        == client.completions.create(model=NAME, prompt="One, two,", max_tokens=4, temperature=0).choices[0].text
    )
    log = server.output()
    for name in FIELDS:
        assert log.count(f"request field {name!r} accepted") == 1, name
    for name, bad in (("metadata", 5), ("store", "yes"), ("metadata", {"k": 1}), ("prompt_cache_key", 3)):
        r = post(server, "/v1/chat/completions", {"model": NAME, "messages": msgs, "max_tokens": 1, name: bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
    server.wait_idle()


def test_vllms_fields_without_effect_here_are_accepted_unchanged_and_logged_once(server, client):
    """return_token_offsets: vLLM reads it only on its /render endpoints and ignores it on
    generation ones; include_reasoning: false without a reasoning parser."""
    body = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    plain = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    for _ in range(2):
        r = post(server, "/v1/chat/completions", {**body, "return_token_offsets": True})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == plain
    assert server.output().count("request field 'return_token_offsets' accepted") == 1
    r = post(server, "/v1/chat/completions", {**body, "return_token_offsets": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_token_offsets"
    # without --reasoning-parser there is no reasoning for include_reasoning to leave out
    for _ in range(2):
        r = post(server, "/v1/chat/completions", {**body, "include_reasoning": False})
        assert r.status_code == 200 and r.json()["choices"][0]["message"] == {
            "role": "assistant",
            "content": plain,
            "tool_calls": None,
            "reasoning": None,
        }
    assert server.output().count("request field 'include_reasoning' accepted") == 1


def test_reasoning_effort_reaches_the_template_and_verbosity_is_refused(server, client):
    msgs = [{"role": "user", "content": "Count to five."}]
    tpl = "{{ reasoning_effort or 'none' }}|{% for m in messages %}{{ m['content'] }}{% endfor %}"
    extra = {"chat_template": tpl, "return_token_ids": True}
    res = client.chat.completions.create(
        model=NAME, messages=msgs, max_tokens=1, reasoning_effort="low", extra_body=extra
    ).model_dump()
    assert res["prompt_token_ids"] == post(server, "/tokenize", {"prompt": "low|Count to five."}).json()["tokens"]
    clash = {"chat_template_kwargs": {"reasoning_effort": "high"}, **extra}
    r = post(server, "/v1/chat/completions", {"messages": msgs, "reasoning_effort": "low", **clash})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
    r = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1, "verbosity": "low"})
    assert r.status_code == 400 and "verbosity" in r.json()["error"]["message"], r.text
    server.wait_idle()


def test_documents_and_the_thinking_switch_reach_the_template(server, client):
    """vLLM hands `documents` to the template, and with reasoning_effort sets `enable_thinking`
    (reasoning_effort != "none") unless chat_template_kwargs set it."""
    msgs = [{"role": "user", "content": "Q"}]
    tpl = (
        "{{ enable_thinking if enable_thinking is defined else '-' }}|"
        "{% for d in documents or [] %}{{ d['title'] }}:{{ d['text'] }};{% endfor %}|"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )

    def rendered(**body) -> list[int]:
        r = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1, "chat_template": tpl, **body})
        assert r.status_code == 200, r.text
        return r.json()["prompt_token_ids"]

    def tokens(text: str) -> list[int]:
        return post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]

    docs = [{"title": "A", "text": "one"}, {"title": "B", "text": "two"}]
    assert rendered(return_token_ids=True) == tokens("-||Q")
    assert rendered(return_token_ids=True, documents=docs) == tokens("-|A:one;B:two;|Q")
    assert rendered(return_token_ids=True, reasoning_effort="high") == tokens("True||Q")
    assert rendered(return_token_ids=True, reasoning_effort="none") == tokens("False||Q")
    kept = {"chat_template_kwargs": {"enable_thinking": True}}
    assert rendered(return_token_ids=True, reasoning_effort="none", **kept) == tokens("True||Q")
    clash = {"documents": docs, "chat_template_kwargs": {"documents": docs[:1]}}
    r = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1, "chat_template": tpl, **clash})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents", r.text
    r = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1, "documents": [{"title": 1}]})
    assert r.status_code == 400 and "documents" in r.text, r.text
    server.wait_idle()


def test_the_dashboards_families_parse_and_move(server, client):
    """vLLM's Grafana dashboard reads these; prometheus_client's own parser reads our exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict[str, tuple[str, dict[tuple, float]]]:
        text = httpx.get(server.base + "/metrics", timeout=10).text
        return {
            f.name: (f.type, {(s.name, tuple(sorted(s.labels.items()))): s.value for s in f.samples})
            for f in text_string_to_metric_families(text)
        }

    def total(families, name, suffix) -> float:
        return sum(v for (n, _), v in families[name][1].items() if n == name + suffix)

    server.wait_idle()
    before = scrape()
    prompt = "Shared instructions for the dashboard test. " * 4
    for _ in range(2):  # the second reads the first's blocks
        client.completions.create(
            model=NAME, prompt=prompt, max_tokens=5, n=2, temperature=0.8, seed=1, extra_body={"ignore_eos": True}
        )
    server.wait_idle()
    after = scrape()
    expected = {
        "vllm:request_max_num_generation_tokens": "histogram",
        "vllm:request_params_n": "histogram",
        "vllm:request_params_max_tokens": "histogram",
        "vllm:prompt_tokens_cached": "counter",
        "vllm:num_requests_waiting_by_reason": "gauge",
    }
    for name, kind in expected.items():
        assert after[name][0] == kind, name
    assert total(after, "vllm:request_params_n", "_sum") - total(before, "vllm:request_params_n", "_sum") == 4
    assert (
        total(after, "vllm:request_params_max_tokens", "_sum") - total(before, "vllm:request_params_max_tokens", "_sum")
        == 10
    )
    gen = total(after, "vllm:request_max_num_generation_tokens", "_sum")
    assert gen - total(before, "vllm:request_max_num_generation_tokens", "_sum") == 10  # 5 each, no stop
    cached = total(after, "vllm:prompt_tokens_cached", "_total") - total(before, "vllm:prompt_tokens_cached", "_total")
    assert cached >= 16  # the second request's whole blocks
    reasons = {dict(k[1])["reason"]: v for k, v in after["vllm:num_requests_waiting_by_reason"][1].items()}
    assert reasons == {"capacity": 0.0, "deferred": 0.0}
