"""POST /v1/embeddings and /pooling against a real server (MEAN pooling by --pooler-config, the
stage-output cache on) with the official openai client: equal to LLM.embed with the same pooler
config, floats and base64, prefix hits, per-token vectors, refusals."""

from __future__ import annotations

import json

import openai
import pytest
import torch

from .conftest import HTTP, long_text

pytestmark = pytest.mark.slow  # a real server subprocess


MEAN = '{"pooling_type": "MEAN"}'


@pytest.fixture(scope="module", params=["in order", "ahead"])
def server(make_server, request):
    """Steps in order, and scheduled ahead (the stage-output cache's rows then written when a
    step is booked: docs/design.md, "Engine")."""
    ahead = ["--async-scheduling"] if request.param == "ahead" else []
    return make_server("--pooler-config", MEAN, "--enable-stage-output-cache", *ahead)


@pytest.fixture(scope="module")
def llm():
    """The offline reference, configured as the server (the pooler config sets only embeddings' defaults)."""
    from prefixkv import LLM

    return LLM(max_model_len=1024, kv_cache_memory_bytes=64 << 20, pooler_config=MEAN)


def test_embeddings_equal_llm_embed(server, llm):
    """(Beside a completion decoding on: scheduled ahead, the embeddings' steps go ahead with it.)"""
    import threading

    client = openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=120)
    docs = [long_text(31, 40) + " First question?", long_text(31, 40) + " Second question?", "Hello"]
    decoding = threading.Thread(
        target=client.completions.create,
        kwargs=dict(model="HuggingFaceTB/SmolLM2-135M-Instruct", prompt=docs[0], max_tokens=48, temperature=0),
    )
    decoding.start()
    res = client.embeddings.create(model="HuggingFaceTB/SmolLM2-135M-Instruct", input=docs)  # base64 on the wire
    decoding.join()
    got = torch.tensor([d.embedding for d in res.data])
    ref = torch.stack([torch.as_tensor(o.outputs.embedding) for o in llm.embed(docs)])
    assert got.shape == ref.shape and torch.allclose(got, ref.float(), atol=1e-4)
    assert torch.allclose(got.norm(dim=-1), torch.ones(3), atol=1e-4)
    assert [d.index for d in res.data] == [0, 1, 2]
    assert res.usage.prompt_tokens > 0
    # as floats, unnormalized; the shared prefix is a hit
    r = HTTP.post(
        server.base + "/v1/embeddings",
        json={"input": docs[:2], "encoding_format": "float", "normalize": False},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    raw = torch.tensor([d["embedding"] for d in body["data"]])
    assert torch.allclose(torch.nn.functional.normalize(raw, dim=-1), got[:2], atol=1e-4)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # /pooling: "embed" is the same MEAN vector; "token_embed" one vector per token (base64 float32)
    r = HTTP.post(server.base + "/pooling", json={"input": docs[2], "task": "embed"}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["object"] == "pooling"
    assert torch.allclose(torch.tensor(r.json()["data"][0]["data"]), got[2], atol=1e-4)
    r = HTTP.post(server.base + "/pooling", json={"input": docs[0], "task": "token_embed"}, timeout=120)
    rows = torch.tensor(r.json()["data"][0]["data"])
    ref_rows = llm.encode([docs[0]], pooling_task="token_embed")[0].outputs.data
    assert rows.shape == ref_rows.shape and rows.shape[0] == r.json()["usage"]["prompt_tokens"]
    assert torch.allclose(rows, ref_rows.float(), atol=1e-4)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the stage cache served the prefix
    server.wait_idle()
    metrics = HTTP.get(server.base + "/metrics").text.splitlines()
    ahead = [float(line.split()[-1]) for line in metrics if line.startswith("prefixkv:steps_scheduled_ahead_total")]
    assert (sum(ahead) > 0) == ("--async-scheduling" in server.args), ahead


def test_embedding_refusals(server):
    url = server.base + "/v1/embeddings"
    r = HTTP.post(server.base + "/pooling", json={"input": "x", "task": "classify"}, timeout=60)
    assert r.status_code == 400 and "classify" in r.text
    for body, needle in [
        ({"input": "x", "dimensions": 8}, "dimensions"),
        ({"input": []}, "input"),
        ({"input": "x", "model": "nope"}, "nope"),
        ({"input": [10**9]}, "vocabulary"),
        ('{"input": "\\ud800"}', "Unicode"),  # a lone surrogate, as JSON text
        ({"input": "word " * 1100}, "context"),
    ]:
        content = body if isinstance(body, str) else json.dumps(body)
        r = HTTP.post(url, content=content, headers={"Content-Type": "application/json"}, timeout=60)
        assert 400 <= r.status_code < 500 and needle.lower() in r.text.lower(), (body, r.text)
    server.wait_idle()


def test_completion_return_hidden_states_equals_offline(server, llm):
    import base64

    import numpy as np

    from prefixkv import SamplingParams

    prompt = long_text(33, 60) + " In short,"
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "return_hidden_states": True}
    r = HTTP.post(server.base + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    h = r.json()["choices"][0]["hidden_states"]
    got = torch.from_numpy(np.frombuffer(base64.b64decode(h["data"]), dtype="<f4").reshape(h["shape"]).copy())
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, return_hidden_states=True)
    ref = llm.generate([prompt], params, use_tqdm=False)[0]
    assert got.shape == (len(ref.prompt_token_ids) + 4, ref.hidden_states.shape[1])
    assert torch.allclose(got, ref.hidden_states.float(), atol=1e-4)
    for extra, needle in [
        ({"stream": True}, "stream"),
        ({"n": 2}, "n=1"),
    ]:
        r = HTTP.post(server.base + "/v1/completions", json={**body, **extra}, timeout=60)
        assert r.status_code == 400 and needle in r.text, r.text
    chat = {"messages": [{"role": "user", "content": "hi"}], "return_hidden_states": True}
    r = HTTP.post(server.base + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 400 and "return_hidden_states" in r.text
    server.wait_idle()
