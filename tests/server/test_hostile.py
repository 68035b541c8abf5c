"""A hostile client against a real `prefixkv serve`: colliding request ids, bad numbers, huge and
malformed bodies, refused fields, admin routes - each beside an innocent request that must finish
unharmed, and no KV block held afterwards. The graceful-shutdown test is in test_shutdown.py."""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import pytest

from .conftest import HTTP, long_text

pytestmark = pytest.mark.slow  # real server subprocesses: deselected by make test-fast

KEY = "hostile-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(make_server):
    return make_server(
        "--api-key",
        KEY,
        "--max-request-body-bytes",
        "1000000",
        "--max-n",
        "8",
        "--max-prompts-per-request",
        "4",
        env={"VLLM_SERVER_DEV_MODE": "1"},  # POST /reset_prefix_cache exists only in dev mode, as vLLM's
    )


def post(server, path: str, body: dict | str | bytes, timeout: float = 120, **kw) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    headers = {**AUTH, "Content-Type": "application/json", **kw.pop("headers", {})}
    return HTTP.post(server.base + path, content=content, headers=headers, timeout=timeout, **kw)


def complete(server, body: dict) -> dict:
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server, body: dict, result: dict) -> None:
    """Collect a streamed completion into result: text per choice, error events, [DONE] seen."""
    result.update(text={}, errors=[], done=False)
    with HTTP.stream(
        "POST", server.base + "/v1/completions", json={**body, "stream": True}, headers=AUTH, timeout=120
    ) as r:
        result["status"] = r.status_code
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                result["done"] = True
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                result["errors"].append(chunk["error"])
                continue
            for c in chunk["choices"]:
                result["text"][c["index"]] = result["text"].get(c["index"], "") + c["text"]


VICTIM = {"prompt": long_text(1, 60), "max_tokens": 40, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def victim_text(server) -> str:
    """The victim's greedy text, computed alone before any attack: every attacked victim must equal it."""
    return complete(server, VICTIM)["choices"][0]["text"]


class Victim:
    """An innocent streamed request running in a thread while the attack happens."""

    def __init__(self, server, expected: str) -> None:
        self.body = VICTIM
        self.expected = expected
        self.result: dict = {}
        self.thread = threading.Thread(target=stream, args=(server, self.body, self.result))
        self.thread.start()

    def check(self) -> None:
        self.thread.join(120)
        assert self.result["status"] == 200 and self.result["done"], self.result
        assert not self.result["errors"], self.result["errors"]
        assert self.result["text"] == {0: self.expected}


def test_colliding_request_ids_never_mix_requests(server):
    # prompts of several blocks, so that the cache holds them
    a = {"prompt": long_text(11, 40) + " Alpha is", "max_tokens": 10, "temperature": 0}
    b = {"prompt": long_text(12, 40) + " Bravo is", "max_tokens": 10, "temperature": 0}
    alone_a = complete(server, a)["choices"][0]["text"]
    alone_b = complete(server, b)["choices"][0]["text"]
    cases = [
        ({**a, "request_id": "0_x"}, {**b, "request_id": "x", "n": 2}),  # n > 1 sequences used to be "i_<id>"
        ({**a, "request_id": "y-0"}, {**b, "prompt": [b["prompt"], b["prompt"]], "request_id": "y"}),
        ({**a, "request_id": "dup"}, {**b, "request_id": "dup"}),  # the same id twice in flight
    ]
    for first, second in cases:
        results: dict[str, httpx.Response] = {}

        def send(key: str, body: dict, results: dict = results) -> None:
            results[key] = post(server, "/v1/completions", body)

        threads = [threading.Thread(target=send, args=(k, body)) for k, body in (("a", first), ("b", second))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert results["a"].status_code == 200, results["a"].text
        assert results["b"].status_code == 200, results["b"].text
        ra, rb = results["a"].json(), results["b"].json()
        assert [c["text"] for c in ra["choices"]] == [alone_a]
        assert [c["text"] for c in rb["choices"]] == [alone_b] * len(rb["choices"])
        assert ra["id"] == first["request_id"] and rb["id"] == second["request_id"]  # the client's id, displayed
    # the shared cache was not poisoned: an innocent request for the same prefixes, no salt
    again = complete(server, a)
    assert again["choices"][0]["text"] == alone_a
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert complete(server, b)["choices"][0]["text"] == alone_b
    server.wait_idle()


# Values no engine can sample with: each is a 400 naming the field, and the batch it would have
# joined goes on.
INVALID = [
    ("temperature", "Infinity"),
    ("temperature", "NaN"),
    ("temperature", "-1"),
    ("top_p", "NaN"),
    ("top_p", "Infinity"),
    ("top_p", "1.5"),
    ("top_k", "-5"),
    ("min_p", "Infinity"),
    ("min_p", "NaN"),
    ("presence_penalty", "Infinity"),
    ("frequency_penalty", "-Infinity"),
    ("presence_penalty", "NaN"),
    ("repetition_penalty", "Infinity"),
    ("repetition_penalty", "0"),
    ("repetition_penalty", "NaN"),
    ("seed", str(2**64)),
    ("seed", str(-(2**64))),
    ("logprobs", str(10**6)),
    ("logprobs", "-1"),
    ("prompt_logprobs", str(10**6)),
    ("max_tokens", str(2**70)),
    ("max_tokens", "0"),
    ("min_tokens", str(2**70)),
    ("min_tokens", "-1"),
    ("n", str(10**9)),
    ("n", "0"),
    ("n", "9"),  # the server caps n at --max-n 8
    ("repetition_penalty", "2.2e-309"),  # positive, but logits divided by it overflow
]
# Legal but extreme: sampled or refused, never a 5xx.
EXTREME = [
    ("temperature", "1e308"),
    ("seed", str(2**64 - 1)),
    ("top_k", str(2**70)),
    ("seed", "0"),
    ("stop_token_ids", f"[{2**70}]"),
    ("temperature", "1e-300"),
]


def _body(field: str, value: str, extra: str = "") -> str:
    return '{"prompt": "Count: one, two,", "max_tokens": 4, ' + f'{extra}"{field}": {value}}}'


def test_bad_numbers_are_400_and_never_hurt_a_running_request(server, victim_text):
    victim = Victim(server, victim_text)
    for field, value in INVALID:
        r = post(server, "/v1/completions", _body(field, value))
        assert r.status_code == 400, (field, value, r.status_code, r.text)
        err = r.json()["error"]
        assert field in err["message"] or err["param"] == field, (field, value, r.text)
    for field, value in EXTREME:
        for extra in ("", '"min_tokens": 3, '):  # min_tokens masks EOS: a path of its own
            r = post(server, "/v1/completions", _body(field, value, extra))
            assert r.status_code in (200, 400), (field, value, r.status_code, r.text)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for field, value in [("temperature", "Infinity"), ("top_logprobs", "100"), ("seed", str(2**64))]:
        r = post(server, "/v1/chat/completions", json.dumps(chat)[:-1] + f', "logprobs": true, "{field}": {value}}}')
        assert r.status_code == 400, (field, r.text)
    victim.check()
    server.wait_idle()


def test_streamed_bad_values_are_refused_before_the_stream_starts(server, victim_text):
    victim = Victim(server, victim_text)
    r = post(server, "/v1/completions", _body("temperature", "Infinity", '"stream": true, '))
    assert r.status_code == 400 and "temperature" in r.text
    victim.check()
    server.wait_idle()


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_idle_server_uses_no_cpu_after_refusals(server):
    refusals = [
        _body("seed", str(2**64)),
        _body("temperature", "Infinity"),
        '{"prompt": "x", "max_tokens": ',
        '{"prompt": "\\ud800 lone surrogate"}',
        json.dumps({"prompt": "x", "tools": [{"type": "function"}]}),
        json.dumps({"prompt": [[10**9]]}),
        json.dumps({"prompt": "x" * 999_000}),
    ]
    for body in refusals:
        r = post(server, "/v1/completions", body)
        assert 400 <= r.status_code < 500, (body[:80], r.status_code, r.text)
    # a refusal that left a loop spinning (a stuck waiter, a busy engine thread) would still spin
    # now: one window after all of them catches it (one window per refusal cost 16 s of the suite)
    server.wait_idle()
    time.sleep(0.3)
    before = _cpu_seconds(server.proc.pid)
    time.sleep(2.0)
    used = _cpu_seconds(server.proc.pid) - before
    assert used < 0.2, f"the idle server used {used:.2f} s of CPU in 2 s after {len(refusals)} refusals"


def test_malformed_text_is_a_400_not_a_500(server, victim_text):
    victim = Victim(server, victim_text)
    chat = "/v1/chat/completions"
    cases = [
        ("/v1/completions", '{"prompt": "\\ud800 lone surrogate", "max_tokens": 2}', "Unicode"),
        ("/v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "Unicode"),
        (chat, '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}', "Unicode"),
        (chat, '{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}', "text"),
        (chat, '{"messages": [{"role": "user", "content": [{"type": "text", "text": null}]}]}', "text"),
        (chat, '{"messages": [{"role": "user", "content": [{"type": "text"}]}]}', "text"),
        (chat, '{"messages": [{"role": "user", "content": ["just a string"]}]}', "dictionary"),
        (chat, '{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "image_url"),
        # a field the response echoes (request_id is its id): refused before the response starts,
        # streamed or not (a stream used to die after its status line)
        ("/v1/completions", '{"prompt": "x", "max_tokens": 2, "request_id": "\\ud800"}', "request_id"),
        ("/v1/completions", '{"prompt": "x", "max_tokens": 2, "request_id": "\\ud800", "stream": true}', "request_id"),
        (
            chat,
            '{"messages": [{"role": "user", "content": "x"}], "request_id": "\\ud800", "stream": true}',
            "request_id",
        ),
        ("/v1/responses", '{"input": "x", "max_output_tokens": 2, "metadata": {"k": "\\udfff"}}', "metadata.k"),
        # Anthropic's Messages API: the same checks under its shapes (and its error body)
        ("/v1/messages", '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}', "Unicode"),
        (
            "/v1/messages",
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}], "max_tokens": 2}',
            "text",
        ),
        (
            "/v1/messages",
            '{"messages": [{"role": "user", "content": [{"type": "tool_result"}]}], "max_tokens": 2}',
            "tool_use_id",
        ),
        (
            "/v1/messages",
            '{"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", '
            '"input": 3}]}], "max_tokens": 2}',
            "input",
        ),
        (
            "/v1/messages",
            '{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": true, "temperature": -1}',
            "temperature",
        ),
        ("/v1/messages", '{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', "max_tokens"),
        ("/v1/messages", '{"messages": "x", "max_tokens": 2}', "messages"),
        ("/v1/messages", "not json", "json"),
    ]
    for path, body, needle in cases:
        r = post(server, path, body)
        assert r.status_code == 400, (body, r.status_code, r.text)
        assert needle.lower() in r.json()["error"]["message"].lower(), (body, r.text)
    victim.check()
    server.wait_idle()


def test_unimplemented_fields_are_refused_by_name(server):
    base = {"prompt": "x", "max_tokens": 2}
    for field, value in [
        ("functions", [{"name": "f"}]),
        ("tools", []),
        ("early_stopping", True),
        ("guided_json", {"type": "object"}),
        ("no_such_field", 1),
        ("best_of", 2),
    ]:
        r = post(server, "/v1/completions", {**base, field: value})
        assert r.status_code == 400 and field in r.json()["error"]["message"], (field, r.text)
    r = post(
        server,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "tool_choice": "auto"},
    )
    assert r.status_code == 400 and "tool_choice" in r.text
    # fields a client sends as null, and OpenAI's `user`, are fine
    assert post(server, "/v1/completions", {**base, "tools": None, "user": "me"}).status_code == 200


def test_limits_on_size_and_count(server, victim_text):
    victim = Victim(server, victim_text)
    # over the body cap: 413 from Content-Length, before the body is read
    r = post(server, "/v1/completions", json.dumps({"prompt": "word " * 300_000}))
    assert r.status_code == 413, r.text
    # over the cap without a Content-Length (chunked upload): 413 while reading

    def chunks():
        yield b'{"prompt": "'
        for _ in range(300):
            yield b"word " * 1000
        yield b'"}'

    r = HTTP.post(
        server.base + "/v1/completions",
        content=chunks(),
        headers={**AUTH, "Content-Type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413, r.text
    # under the cap but far over the context: refused before tokenizing, health answers meanwhile
    big = json.dumps({"prompt": "word " * 190_000})
    r = post(server, "/v1/completions", big)
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"], r.text
    assert HTTP.get(server.base + "/health", timeout=5).status_code == 200
    # under the character bound: tokenized (in a worker thread), then refused by its token count
    r = post(server, "/v1/completions", {"prompt": " ".join(f"w{i}" for i in range(12_000)), "max_tokens": 1})
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"], r.text
    r = post(server, "/v1/completions", {"prompt": ["a", "b", "c", "d", "e"], "max_tokens": 1})
    assert r.status_code == 400 and "prompts" in r.text
    victim.check()
    m = server.metrics()
    assert m["prefixkv:http_request_errors_total"] >= 4
    server.wait_idle()


def test_salts_isolate_tenants_in_chat_prompt_logprobs_and_after_reset(server):
    def cached(path: str, body: dict, salt: str | None) -> int:
        body = {**body, **({"cache_salt": salt} if salt is not None else {})}
        r = post(server, path, body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    # prompts of a few blocks: the cache holds their full blocks, per tenant
    chat = {"messages": [{"role": "user", "content": long_text(21, 40)}], "max_tokens": 2, "temperature": 0}
    assert cached("/v1/chat/completions", chat, "chat-a") == 0
    assert cached("/v1/chat/completions", chat, "chat-b") == 0
    assert cached("/v1/chat/completions", chat, "chat-a") > 0
    # a prompt_logprobs request computes its whole prompt but still caches it - in its tenant only
    scored = {"prompt": long_text(22, 40), "max_tokens": 2, "prompt_logprobs": 1}
    assert cached("/v1/completions", scored, "lp-a") == 0
    plain = {"prompt": scored["prompt"], "max_tokens": 2}
    assert cached("/v1/completions", plain, "lp-b") == 0
    assert cached("/v1/completions", plain, "lp-a") > 0
    server.wait_idle()
    assert post(server, "/reset_prefix_cache", {}).status_code == 200
    assert cached("/v1/completions", plain, "lp-b") == 0  # nothing survives a reset
    assert cached("/v1/completions", plain, "lp-a") == 0
    assert cached("/v1/completions", plain, "lp-b") > 0 and cached("/v1/completions", plain, "lp-c") == 0
    server.wait_idle()
