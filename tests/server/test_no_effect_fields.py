"""Fields the openai SDK and agent frameworks send whose effect does not apply to a local engine
(store, metadata, service_tier, safety_identifier, user, prompt_cache_key) are accepted - same
output as without them - and logged once each; a wrong type is still a 400 naming the field;
reasoning_effort reaches the chat template (as vLLM passes it); verbosity is refused by name."""

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
    assert done.choices[0].text == client.completions.create(
        model=NAME, prompt="One, two,", max_tokens=4, temperature=0
    ).choices[0].text
    log = server.output()
    for name in FIELDS:
        assert log.count(f"request field {name!r} accepted") == 1, name
    for name, bad in (("metadata", 5), ("store", "yes"), ("metadata", {"k": 1}), ("prompt_cache_key", 3)):
        r = post(server, "/v1/chat/completions", {"model": NAME, "messages": msgs, "max_tokens": 1, name: bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
    server.wait_idle()


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
