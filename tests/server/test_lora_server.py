"""LoRA through a real `prefixkv serve` with the official openai client: --lora-modules (both
forms), "model": adapter, /v1/models with parents, dynamic load / unload, and their errors."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from prefixkv import LLM, SamplingParams
from prefixkv.lora import LoRARequest

from ..lora.conftest import Fixture

pytestmark = pytest.mark.slow
MAX_NEW = 6


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return Fixture("llama", tmp_path_factory.mktemp("lora-server"))


@pytest.fixture(scope="module")
def server(make_server, fx):
    spec = json.dumps({"name": "all", "path": fx.adapters["all"]})
    return make_server(
        str(fx.base),
        "--dtype",
        "float32",
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--max-model-len",
        "64",
        "--allow-runtime-lora-updating",
        "--lora-modules",
        f"qv={fx.adapters['qv']}",
        spec,
    )


def _offline(fx, name, prompt):
    llm = LLM(
        str(fx.base), dtype="float32", device="cpu", num_blocks=32, block_size=8, enable_lora=True, max_lora_rank=8
    )
    lora = None if name is None else LoRARequest(name, 1, fx.adapters[name])
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False, lora_request=lora)[0].outputs[0].text


def test_lora_server(server, fx):
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="none")
    models = {m.id: m for m in client.models.list().data}
    base = str(fx.base)
    assert set(models) == {base, "qv", "all"}
    assert models["qv"].parent == base and models["all"].parent == base

    prompt = fx.prompts[0]
    texts = {}
    for name in (None, "qv", "all"):
        out = client.completions.create(
            model=name or base, prompt=prompt, max_tokens=MAX_NEW, temperature=0, extra_body={"ignore_eos": True}
        )
        assert out.model == (name or base)
        texts[name] = out.choices[0].text
        assert texts[name] == _offline(fx, name, prompt), name
    assert texts["qv"] != texts[None]

    # dynamic load / unload, as vLLM
    r = httpx.post(server.base + "/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": fx.adapters["mlp"]})
    assert r.status_code == 200, r.text
    out = client.completions.create(
        model="mlp", prompt=prompt, max_tokens=MAX_NEW, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].text == _offline(fx, "mlp", prompt)
    assert "mlp" in {m.id for m in client.models.list().data}
    again = httpx.post(
        server.base + "/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": fx.adapters["mlp"]}
    )
    assert again.status_code == 400
    bad = httpx.post(server.base + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/no/such/dir"})
    assert bad.status_code == 400 and "cannot load a LoRA adapter from that path" in bad.text
    r = httpx.post(server.base + "/v1/unload_lora_adapter", json={"lora_name": "mlp"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="mlp", prompt=prompt, max_tokens=2)
    assert httpx.post(server.base + "/v1/unload_lora_adapter", json={"lora_name": "mlp"}).status_code == 404
    # the chat route resolves adapters too (this tiny tokenizer has no chat template: past the model check)
    with pytest.raises(openai.BadRequestError, match="chat template"):
        client.chat.completions.create(model="qv", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="mlp", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    server.wait_idle()
    info = [line for line in httpx.get(server.base + "/metrics").text.splitlines() if line.startswith("vllm:lora_")]
    assert len(info) == 1 and 'max_lora="2"' in info[0], info
