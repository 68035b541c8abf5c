"""use_beam_search through a real `prefixkv serve` on a tiny random float32 Llama: the n choices
equal transformers' beam search, on /v1/completions (several prompts, the openai client) and
/v1/chat/completions; the beams' prefixes are cache hits and every block is free afterwards;
fields beam search does not implement are refused by name."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from ..engine.test_beam_search import hf_beams
from ..model.test_model_hf_folder import _make, _write_tokenizer

WIDTH, MAX_NEW = 3, 6
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("beam-server")
    hf = _make("llama", max_position_embeddings=128)
    hf.save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder)
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder, hf


@pytest.fixture(scope="module")
def server(make_server, tiny):
    return make_server("--model", str(tiny[0]), "--max-model-len", "96", "--dtype", "float32")


def post(server, path, body):
    return httpx.post(server.base + path, json=body, timeout=120)


def test_completions_equal_transformers(server, tiny):
    _, hf = tiny
    prompts = [[5, 17, 42, 99, 3, 250, 7, 7, 31, 64, 12] * 3, [200, 1, 2, 3]]  # the first: 2 full blocks
    before = server.metrics()["vllm:prefix_cache_hits_total"]
    body = {
        "prompt": prompts,
        "n": WIDTH,
        "max_tokens": MAX_NEW,
        "use_beam_search": True,
        "ignore_eos": True,
        "return_token_ids": True,
        "length_penalty": 1.0,
        "logprobs": 2,
    }
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    res = r.json()
    assert [c["index"] for c in res["choices"]] == list(range(2 * WIDTH))
    for i, prompt in enumerate(prompts):
        want, scores = hf_beams(hf, prompt, WIDTH, MAX_NEW)
        choices = res["choices"][i * WIDTH : (i + 1) * WIDTH]
        assert [c["token_ids"] for c in choices] == want
        assert [sum(c["logprobs"]["token_logprobs"]) for c in choices] == pytest.approx(scores, abs=1e-4)
        # the top 2 plus the beam's token when it is not among them (a beam often takes a lower
        # one); keyed by text, so tokens that decode alike (partial UTF-8 bytes) are one entry
        assert all(1 <= len(top) <= 3 for c in choices for top in c["logprobs"]["top_logprobs"])
        assert all(c["finish_reason"] == "length" and c["prompt_token_ids"] == prompt for c in choices)
        tok = Tokenizer.from_file(str(tiny[0] / "tokenizer.json"))
        assert [c["text"] for c in choices] == [tok.decode(t) for t in want]
    assert res["usage"]["completion_tokens"] == 2 * WIDTH * MAX_NEW
    assert res["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    m = server.wait_idle()  # every block free again
    assert m["vllm:prefix_cache_hits_total"] > before  # the steps found the beams' prefixes


def test_openai_client_and_chat(server, tiny):
    _, hf = tiny
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="x")
    out = client.completions.create(
        model=str(tiny[0]),
        prompt=[9, 8, 7, 6, 5],
        n=2,
        max_tokens=4,
        extra_body={"use_beam_search": True, "ignore_eos": True, "return_token_ids": True},
    )
    want, _ = hf_beams(hf, [9, 8, 7, 6, 5], 2, 4)
    assert [c.model_extra["token_ids"] for c in out.choices] == want
    msgs = [{"role": "user", "content": "beams"}]
    ids = post(server, "/tokenize", {"messages": msgs}).json()["tokens"]
    chat = client.chat.completions.create(
        model=str(tiny[0]),
        messages=msgs,
        n=2,
        max_tokens=4,
        logprobs=True,
        top_logprobs=3,
        extra_body={"use_beam_search": True, "ignore_eos": True, "return_token_ids": True},
    )
    want, scores = hf_beams(hf, ids, 2, 4)
    assert [c.model_extra["token_ids"] for c in chat.choices] == want
    assert [sum(t.logprob for t in c.logprobs.content) for c in chat.choices] == pytest.approx(scores, abs=1e-4)
    assert all(len(t.top_logprobs) == 3 for c in chat.choices for t in c.logprobs.content)
    tok = Tokenizer.from_file(str(tiny[0] / "tokenizer.json"))
    assert [c.message.content for c in chat.choices] == [tok.decode(t) for t in want]
    server.wait_idle()


def test_what_beam_search_does_not_implement_is_refused_by_name(server):
    base = {"prompt": "x", "max_tokens": 2, "n": 2, "use_beam_search": True}
    for field, value in [
        ("stream", True),
        ("logprobs", 5),  # more than the 2 * n candidates a step ranks
        ("echo", True),
        ("early_stopping", True),
        ("top_p", 0.5),
        ("stop", ["a"]),
        ("min_tokens", 1),
        ("presence_penalty", 0.5),
        ("logit_bias", {"5": 1.0}),
        ("structured_outputs", {"regex": "a+"}),
        ("length_penalty", float("1e9")),
    ]:
        r = post(server, "/v1/completions", {**base, field: value})
        assert r.status_code == 400 and field in r.json()["error"]["message"], (field, r.text)
    r = post(server, "/v1/completions", {**base, "n": 11})  # 22 logprobs a step > max_logprobs 20
    assert r.status_code == 400 and "max_logprobs" in r.text, r.text
    r = post(server, "/v1/completions", {**base, "n": 0})
    assert r.status_code == 400 and "n" in r.json()["error"]["message"]
    # neutral values are fine: what a client sends as its defaults
    ok = {**base, "top_p": 1.0, "presence_penalty": 0, "stop": [], "temperature": 0.7, "seed": 3}
    assert post(server, "/v1/completions", ok).status_code == 200
    # beam search's own fields without beam search would change nothing: refused
    for field, value in [("length_penalty", 0.5), ("early_stopping", True)]:
        r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, field: value})
        assert r.status_code == 400 and field in r.json()["error"]["message"], (field, r.text)
        r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], field: value})
        assert r.status_code == 400 and field in r.json()["error"]["message"], (field, r.text)
    assert server.healthy()
    server.wait_idle()


def test_a_client_gone_mid_search_leaves_nothing_held(server):
    before = server.metrics().get("vllm:request_success_total", 0.0)  # absent before any request
    prompts = [[3, i] * 10 for i in range(8)]
    body = {"prompt": prompts, "n": 8, "max_tokens": 70, "use_beam_search": True, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):  # 70 steps of 64 beams: seconds
        httpx.post(server.base + "/v1/completions", json=body, timeout=0.2)
    m = server.wait_idle()  # the step running when it left was aborted; no later step started
    assert m["vllm:kv_cache_usage_perc"] == 0
    assert m["vllm:request_success_total"] - before < 64 * 70 / 2  # cut short: most steps never ran
    assert post(server, "/v1/completions", {**body, "max_tokens": 2}).status_code == 200
