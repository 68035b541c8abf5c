"""The served constraint fields, in-process (the app around an engine on the session's model):
logit_bias / allowed_token_ids / bad_words on both routes change the output, bad values are a 400
naming the field, and every block is free afterwards."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(default_lm):
    from prefixkv.config import EngineConfig
    from prefixkv.engine.llm_engine import LLMEngine
    from prefixkv.server.app import create_app

    engine = LLMEngine(
        EngineConfig(dtype="float32", device="cpu", num_blocks=96, max_model_len=1024), loaded=default_lm
    )
    app = create_app(engine)
    with TestClient(app) as c:
        c.engine = engine  # type: ignore[attr-defined]
        yield c


@pytest.fixture(autouse=True)
def blocks_free_after(client):
    yield
    engine = client.engine
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


def completion(client, **fields) -> dict:
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_logit_bias_allowed_token_ids_and_bad_words_change_the_completion(client):
    tok = client.engine.tokenizer
    plain = completion(client)
    assert plain["text"].startswith(" Paris")
    target = tok.encode(" banana")[0]
    assert completion(client, logit_bias={str(target): 100})["text"] == " banana" * 3
    allowed = tok.encode(" one two")
    text = completion(client, allowed_token_ids=allowed)["text"]
    assert set(tok.encode(text)) <= set(allowed)
    assert "Paris" not in completion(client, bad_words=["Paris"])["text"]
    chat = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 3,
            "temperature": 0,
            "logit_bias": {str(target): 100},
        },
    )
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"].split() == ["banana"] * 3, (
        chat.text
    )


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
    ],
)
def test_bad_values_are_a_400_naming_the_field(client, fields, needle):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, **fields})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "country": {"enum": ["France", "Spain"]}},
    "required": ["city", "country"],
}


def chat(client, **fields) -> dict:
    body = {
        "messages": [{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        "max_tokens": 30,
        "temperature": 0,
        **fields,
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_response_format_and_structured_outputs(client):
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "capital", "schema": SCHEMA, "strict": True}}
    answer = chat(client, response_format=fmt)
    jsonschema.validate(json.loads(answer["message"]["content"]), SCHEMA)
    assert answer["finish_reason"] == "stop"
    obj = chat(client, response_format={"type": "json_object"}, structured_outputs=None, max_tokens=40)
    assert obj["message"]["content"].startswith("{")  # unconstrained, the model answers in prose
    if obj["finish_reason"] == "stop":
        assert isinstance(json.loads(obj["message"]["content"]), dict)
    choice = completion(client, structured_outputs={"choice": [" Lyon", " Rome"]}, max_tokens=4)
    assert choice["text"] in (" Lyon", " Rome") and choice["finish_reason"] == "stop"
    assert chat(client, response_format={"type": "text"}, max_tokens=2)["finish_reason"] == "length"


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}}, "bogus"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"structured_outputs": {"regex": "a("}}, "regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
        ({"structured_outputs": {"jsonn": {}}}, "jsonn"),
        ({"structured_outputs": {"json": {}}, "response_format": {"type": "json_object"}}, "not both"),
        ({"guided_json": {"type": "object"}}, "structured_outputs"),
        # bounded before anything compiles: 20,000 options took ~4 s of the one compile slot
        ({"structured_outputs": {"choice": [f"option {i}" for i in range(20000)]}}, "at most 1024"),
        ({"structured_outputs": {"regex": "a" * 70000}}, "at most 65536 are accepted"),
    ],
)
def test_bad_structured_requests_are_a_400_naming_the_problem(client, fields, needle):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, **fields})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
