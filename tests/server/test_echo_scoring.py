"""Scoring a prompt without generating: `echo` with `max_tokens: 0` on /v1/completions (what
lm-evaluation-harness's log-likelihood requests send), against transformers' log-softmax of the
same GGUF - after the prompt's prefix was cached, with and without the stage-output cache."""

from __future__ import annotations

import openai
import pytest
import torch

from .conftest import API_KEY, HTTP, long_text

MODEL = "smol"  # a name the shared api_server serves
SHARED = long_text(7, 40)  # a few-shot prefix the scored prompts share: two full blocks to cache
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ENDINGS = [" The answer is blue.", " The answer is a quiet harbor."]


@pytest.fixture(scope="module", params=["recompute", pytest.param("stage-output-cache", marks=pytest.mark.slow)])
def server(request, api_server, make_server):
    """The shared API server (cached prefixes are recomputed for prompt logprobs), or one that
    reads them back from the stage-output cache."""
    if request.param == "recompute":
        return api_server
    return make_server("--served-model-name", MODEL, "--api-key", API_KEY, "--enable-stage-output-cache")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def tok(default_gguf_path):
    from prefixkv.model.loader import load_tokenizer

    return load_tokenizer(default_gguf_path)


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def check_echo(choice, ids: list[int], ref: torch.Tensor, k: int) -> None:
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) == len(lp.token_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    for pos in range(1, len(ids)):
        row = ref[pos - 1]
        assert lp.token_logprobs[pos] == pytest.approx(row[ids[pos]].item(), abs=1e-4)
        top = lp.top_logprobs[pos]
        assert k <= len(top) <= k + 1 and lp.tokens[pos] in top
        assert max(top.values()) == pytest.approx(row.max().item(), abs=1e-4)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert choice.finish_reason == "length" and choice.model_extra.get("stop_reason") is None


def test_echo_max_tokens_0_scores_the_prompt_equal_to_transformers(server, client, tok, hf_ref_model):
    # the shared prefix is cached first: the scoring requests must still score every position
    client.completions.create(model=MODEL, prompt=SHARED, max_tokens=1, temperature=0)
    prompts = [tok.encode(SHARED + e) for e in ENDINGS]
    res = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=0, echo=True, logprobs=2, temperature=0, extra_body={"seed": 1234}
    )
    assert [c.index for c in res.choices] == [0, 1]
    for choice, ids in zip(res.choices, prompts):
        assert choice.text == tok.decode(ids)
        check_echo(choice, ids, hf_logprobs(hf_ref_model, ids), 2)
    assert res.usage.prompt_tokens == sum(map(len, prompts))
    assert res.usage.completion_tokens == 0 and res.usage.total_tokens == res.usage.prompt_tokens
    if "--enable-stage-output-cache" in server.proc.args:  # hits are read back, not recomputed
        assert res.usage.prompt_tokens_details.cached_tokens > 0
    # text prompts, n=2, return_token_ids: each choice is the prompt alone
    text = SHARED + ENDINGS[0]
    res = client.completions.create(
        model=MODEL,
        prompt=text,
        max_tokens=0,
        echo=True,
        logprobs=0,
        n=2,
        temperature=1.0,
        extra_body={"return_token_ids": True},
    )
    assert len(res.choices) == 2
    for c in res.choices:
        assert c.text == text and c.model_extra["token_ids"] == []
        assert c.logprobs.token_logprobs[1:] == pytest.approx(res.choices[0].logprobs.token_logprobs[1:], abs=1e-6)
    # without logprobs: the echo alone
    res = client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True)
    assert res.choices[0].text == text and res.choices[0].logprobs is None
    assert server.wait_idle()["vllm:kv_cache_usage_perc"] == 0


def test_echo_max_tokens_0_streamed(server, client, tok, hf_ref_model):
    ids = tok.encode(SHARED + ENDINGS[1])
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=ids,
            max_tokens=0,
            echo=True,
            logprobs=1,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    choices = [c.choices[0] for c in chunks if c.choices]
    assert len(choices) == 1 and choices[0].text == tok.decode(ids)
    check_echo(choices[0], ids, hf_logprobs(hf_ref_model, ids), 1)
    assert chunks[-1].usage.completion_tokens == 0 and chunks[-1].usage.prompt_tokens == len(ids)
    assert server.wait_idle()["vllm:kv_cache_usage_perc"] == 0


def test_max_tokens_0_refusals(server):
    url = server.base + "/v1/completions"
    for body, param in (
        ({"prompt": "Hello", "max_tokens": 0}, "max_tokens"),  # nothing to answer without echo (vLLM: 400)
        ({"prompt": "Hello", "max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens"),
        ({"prompt": "Hello", "max_tokens": -1, "echo": True}, None),
    ):
        r = HTTP.post(url, json=body, headers=AUTH, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "max_tokens" in err["message"] or "min_tokens" in err["message"]
        if param:
            assert err["param"] == param
    chat = HTTP.post(
        server.base + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0},
        headers=AUTH,
        timeout=30,
    )
    assert chat.status_code == 400 and "max_tokens" in chat.json()["error"]["message"]
    assert server.healthy()
    from prefixkv import SamplingParams

    with pytest.raises(ValueError, match="max_tokens"):  # offline too, as vLLM's SamplingParams
        SamplingParams(max_tokens=0)
