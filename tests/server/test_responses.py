"""/v1/responses against a real `prefixkv serve` subprocess, driven by the official openai SDK's
Responses API and LangChain's ChatOpenAI(use_responses_api=True). The oracle is the server's own
/v1/chat/completions on the same messages (greedy): a response is that chat completion, and a
turn chained with `previous_response_id` is the chat completion of the whole conversation - whose
prompt starts with the previous turn's, so the prefix cache serves it (cached_tokens > 0). Streams
are OpenAI's numbered events (the SDK's stream helper accumulates them), stored responses are an
LRU of the size the environment sets, unimplemented fields are refused by name, and the server
ends idle with every KV block free."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import BaseModel, Field

from .conftest import HTTP, long_text

pytestmark = pytest.mark.slow  # a real server subprocess

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
MAX_STORED = 4
# A short context: the truncation test needs two turns that together overflow it, and every
# prompt token of those turns is prefilled (three times) - at 1024 they were most of the module's
# time. Every other request here fits in it with room to spare.
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def server(make_server):
    return make_server("--max-model-len", str(MAX_MODEL_LEN), env={"PREFIXKV_RESPONSES_MAX_STORED": str(MAX_STORED)})


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base + "/v1", api_key="unused", timeout=120)


def chat_choice(server, messages: list[dict], max_tokens: int, **fields) -> dict:
    """The same request's choice on /v1/chat/completions: the oracle."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **fields}
    r = HTTP.post(server.base + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def chat_text(server, messages: list[dict], max_tokens: int) -> tuple[str, str]:
    choice = chat_choice(server, messages, max_tokens)
    return choice["message"]["content"], choice["finish_reason"]


def test_turns_equal_chat_and_turn_two_hits_the_cache(server, client):
    first = client.responses.create(
        model=MODEL,
        instructions="You answer in one short sentence.",
        input="What is the capital of France?",
        max_output_tokens=24,
        temperature=0,
        metadata={"run": "test"},
    )
    system = {"role": "system", "content": "You answer in one short sentence."}
    user1 = {"role": "user", "content": "What is the capital of France?"}
    text1, finish1 = chat_text(server, [system, user1], 24)
    assert first.id.startswith("resp_") and first.object == "response"
    assert first.output_text == text1 and first.output_text
    assert first.status == ("incomplete" if finish1 == "length" else "completed")
    assert [item.type for item in first.output] == ["message"] and first.output[0].role == "assistant"
    assert first.metadata == {"run": "test"} and first.model == MODEL
    assert first.usage.output_tokens <= 24 and first.usage.total_tokens == (
        first.usage.input_tokens + first.usage.output_tokens
    )

    # Turn 2 as items. Instructions do not carry over (OpenAI's rule), the conversation does: sent
    # again, they render in the same place and the previous prompt is a prefix of this one.
    second = client.responses.create(
        model=MODEL,
        instructions="You answer in one short sentence.",
        previous_response_id=first.id,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "And of Italy?"}]}],
        max_output_tokens=16,
        temperature=0,
    )
    history = [system, user1, {"role": "assistant", "content": text1}, {"role": "user", "content": "And of Italy?"}]
    assert second.output_text == chat_text(server, history, 16)[0]
    assert second.previous_response_id == first.id
    # the whole previous prompt is a prefix of this one: its full blocks come from the cache
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert second.usage.input_tokens > first.usage.input_tokens

    stored = HTTP.get(f"{server.base}/v1/responses/{second.id}", timeout=10).json()
    assert stored["output"][0]["content"][0]["text"] == second.output_text and stored["id"] == second.id
    server.wait_idle()


def test_stream_events_in_order(server, client):
    events = []
    with client.responses.stream(
        model=MODEL,
        input="Say hello.",
        max_output_tokens=64,
        temperature=0,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    ) as stream:
        for event in stream:
            events.append(event)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas) and len(deltas) > 2
    assert types[4 + len(deltas) :] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    text = "".join(e.delta for e in deltas)
    assert final.status == "completed" and final.output_text == text
    oracle = chat_choice(server, [{"role": "user", "content": "Say hello."}], 64, logprobs=True, top_logprobs=2)
    assert text == oracle["message"]["content"]
    # logprobs (asked with include): per delta, and all of them on the final message, as chat's
    expected = [
        (c["token"], c["logprob"], [t["token"] for t in c["top_logprobs"]]) for c in oracle["logprobs"]["content"]
    ]
    streamed = [(lp.token, lp.logprob, [t.token for t in lp.top_logprobs]) for e in deltas for lp in e.logprobs]
    final_lps = final.output[0].content[0].logprobs
    assert [t for t, _, _ in streamed] == [t for t, _, _ in expected] == [lp.token for lp in final_lps]
    assert [lp for _, lp, _ in streamed] == pytest.approx([lp for _, lp, _ in expected], abs=1e-4)
    assert all(len(top) == 2 for _, _, top in streamed)
    assert events[0].response.status == "in_progress" and final.usage.output_tokens > 0

    # a cut-short stream ends with response.incomplete, as OpenAI's
    raw = client.responses.create(model=MODEL, input="Count to fifty.", max_output_tokens=3, stream=True)
    last = list(raw)[-1]
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"

    # a client that goes away mid-stream aborts the request: every block is free again
    raw = client.responses.create(model=MODEL, input="Count to fifty.", max_output_tokens=200, stream=True)
    for i, _ in enumerate(raw):
        if i == 6:
            break
    raw.close()
    server.wait_idle()


class City(BaseModel):
    city: str = Field(max_length=12)
    country: str = Field(max_length=12)


def test_structured_output_and_function_calls(server, client):
    parsed = client.responses.parse(
        model=MODEL, input="What is the capital of France?", text_format=City, max_output_tokens=60, temperature=0
    )
    assert isinstance(parsed.output_parsed, City) and parsed.output_parsed.city

    weather = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"],
    }
    tools = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": weather}]
    call = client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=tools,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
        temperature=0,
    )
    (item,) = call.output
    assert item.type == "function_call" and item.name == "get_weather"
    jsonschema.validate(json.loads(item.arguments), weather)

    # the call's result goes back as a function_call_output; the model answers in text
    answer = client.responses.create(
        model=MODEL,
        previous_response_id=call.id,
        input=[{"type": "function_call_output", "call_id": item.call_id, "output": "Sunny, 21 C"}],
        tools=tools,
        tool_choice="none",
        max_output_tokens=16,
        temperature=0,
    )
    assert answer.output[0].type == "message" and answer.usage.input_tokens_details.cached_tokens > 0

    # streamed, a named call arrives as a function_call item with its arguments
    with client.responses.stream(
        model=MODEL,
        input="What is the weather in Rome?",
        tools=tools,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
        temperature=0,
    ) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in types and "response.output_text.delta" not in types
    (streamed,) = final.output
    assert streamed.type == "function_call" and json.loads(streamed.arguments)["city"]
    server.wait_idle()


def test_store_bound_delete_and_refusals(server, client):
    from openai import BadRequestError, NotFoundError

    def tiny(**fields):
        return client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, temperature=0, **fields)

    unstored = tiny(store=False)
    with pytest.raises(BadRequestError) as e:
        tiny(previous_response_id=unstored.id)
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(NotFoundError):
        client.responses.retrieve(unstored.id)

    oldest = tiny()
    for _ in range(MAX_STORED):  # the LRU keeps MAX_STORED: the oldest is evicted
        tiny()
    with pytest.raises(BadRequestError):
        tiny(previous_response_id=oldest.id)

    kept = tiny(store=None)  # null is the default: stored
    assert client.responses.retrieve(kept.id).id == kept.id
    client.responses.delete(kept.id)
    with pytest.raises(NotFoundError):
        client.responses.retrieve(kept.id)
    salted = tiny(extra_body={"cache_salt": "tenant-a"})
    with pytest.raises(BadRequestError):  # another tenant's (or no tenant's) chain is not found
        tiny(previous_response_id=salted.id)
    assert tiny(previous_response_id=salted.id, extra_body={"cache_salt": "tenant-a"}).status

    refused = {
        "background": {"background": True},
        "include": {"include": ["reasoning.encrypted_content"]},
        "reasoning.summary": {"reasoning": {"effort": "low", "summary": "auto"}},
        "top_logprobs": {"top_logprobs": 2},
        "stream_options": {"stream_options": {"include_obfuscation": True}},
        "conversation": {"conversation": "conv_1"},
        "text.verbosity": {"text": {"verbosity": "low"}},
        "tools": {"tools": [{"type": "web_search"}]},
        "input": {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAAA"}]},
        "max_output_tokens": {"max_output_tokens": 0},
        "previous_response_id": {"previous_response_id": "resp_unknown"},
        "not_a_field": {"not_a_field": 1},
    }
    for param, fields in refused.items():
        r = HTTP.post(f"{server.base}/v1/responses", json={"model": MODEL, "input": "Hi", **fields}, timeout=30)
        assert r.status_code == 400, (param, r.text)
        assert r.json()["error"]["param"] == param, r.text
    r = HTTP.post(f"{server.base}/v1/responses/{oldest.id}/cancel", timeout=10)
    assert r.status_code == 404
    r = HTTP.post(f"{server.base}/v1/responses/{salted.id}/cancel", timeout=10)
    assert r.status_code == 400 and "synchronous" in r.json()["error"]["message"]
    long_input = "word " * 2000
    r = HTTP.post(f"{server.base}/v1/responses", json={"model": MODEL, "input": long_input}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    assert server.healthy()
    server.wait_idle()


def test_truncation_auto_drops_the_oldest_messages(server, client):
    from openai import BadRequestError

    # each turn about half the context (MAX_MODEL_LEN): the two together are over it by ~40 tokens
    first = client.responses.create(
        model=MODEL, input=long_text(1, 125), max_output_tokens=4, temperature=0, instructions="Be brief."
    )
    second_input = long_text(2, 120)
    with pytest.raises(BadRequestError) as e:  # the whole conversation no longer fits the context
        client.responses.create(model=MODEL, previous_response_id=first.id, input=second_input, max_output_tokens=8)
    assert e.value.body["param"] in ("input", "max_output_tokens")
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=second_input,
        max_output_tokens=8,
        temperature=0,
        instructions="Be brief.",
        truncation="auto",
    )
    assert second.truncation == "auto"
    # what ran: the instructions, then the conversation from its second message (the first turn's
    # long input dropped, its short answer kept) and the new input
    system = {"role": "system", "content": "Be brief."}
    kept = [system, {"role": "assistant", "content": first.output_text}, {"role": "user", "content": second_input}]
    expected = chat_text(server, kept, 8)[0]
    assert second.output_text == expected and second.usage.input_tokens < first.usage.input_tokens + 100
    server.wait_idle()


def test_langchain_use_responses_api(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=server.base + "/v1",
        api_key="unused",
        model=MODEL,
        temperature=0,
        max_tokens=24,
        timeout=120,
        use_responses_api=True,
    )
    message = llm.invoke("What is the capital of France?")
    assert message.text and message.response_metadata["id"].startswith("resp_")
    assert message.usage_metadata["input_tokens"] > 0
    text, _ = chat_text(server, [{"role": "user", "content": "What is the capital of France?"}], 24)
    assert message.text == text

    chained = ChatOpenAI(
        base_url=server.base + "/v1",
        api_key="unused",
        model=MODEL,
        temperature=0,
        max_tokens=8,
        timeout=120,
        use_responses_api=True,
        use_previous_response_id=True,
    )
    follow = chained.invoke([("human", "What is the capital of France?"), message, ("human", "And of Italy?")])
    assert follow.text and follow.usage_metadata["input_token_details"]["cache_read"] > 0

    chunks = list(llm.stream("Say hello."))
    assert "".join(c.text for c in chunks).strip()
    server.wait_idle()


@pytest.mark.parametrize("wild", [False, True], ids=["typed", "wild"])
def test_random_bodies_never_5xx(server, wild):
    """Bodies shaped like the Responses schema - typed ones, which reach the engine, and wild ones
    with junk anywhere: never a 5xx (streamed: never an error event of one), the server keeps
    serving, and no KV block is held afterwards."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**65), 2**65),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=12),
        st.sampled_from(["\ud800", "", "<|im_end|>", "message.output_text.logprobs", "function", "required"]),
    )
    junk = st.recursive(
        scalars,
        lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
        max_leaves=6,
    )

    def mostly(typed):
        return st.one_of(typed, junk) if wild else typed

    texts = st.one_of(st.text(max_size=20), st.sampled_from(["Hello", "Hello", "\ud800", "<|im_end|>"]))
    part = st.fixed_dictionaries(
        {"type": mostly(st.sampled_from(["input_text", "output_text", "input_image"])), "text": mostly(texts)}
    )
    item = st.one_of(
        st.fixed_dictionaries(
            {"role": mostly(st.sampled_from(["user", "system", "developer", "assistant"]))},
            optional={"type": st.just("message"), "content": mostly(st.one_of(texts, st.lists(part, max_size=2)))},
        ),
        st.fixed_dictionaries(
            {"type": st.just("function_call"), "call_id": mostly(texts), "name": mostly(texts)},
            optional={"arguments": mostly(st.just('{"city": "Paris"}'))},
        ),
        st.fixed_dictionaries(
            {"type": st.just("function_call_output"), "call_id": mostly(texts), "output": mostly(texts)}
        ),
    )
    tool = st.fixed_dictionaries(
        {"type": mostly(st.just("function")), "name": mostly(st.sampled_from(["f", "get_weather"]))},
        optional={"parameters": mostly(st.just({"type": "object", "properties": {"a": {"type": "integer"}}}))},
    )
    fields = {
        "instructions": mostly(texts),
        "temperature": mostly(st.one_of(st.floats(0, 2), st.floats(allow_nan=True, allow_infinity=True))),
        "top_p": mostly(st.floats(0.01, 1)),
        "stream": mostly(st.booleans()),
        "store": mostly(st.booleans()),
        "tools": mostly(st.lists(tool, max_size=2)),
        "tool_choice": mostly(st.sampled_from(["none", "required", "auto", {"type": "function", "name": "f"}])),
        "text": mostly(st.sampled_from([{"format": {"type": "json_object"}}, {"format": {"type": "text"}}])),
        "include": mostly(st.lists(st.just("message.output_text.logprobs"), max_size=1)),
        "top_logprobs": mostly(st.integers(0, 3)),
        "cache_salt": mostly(texts),
        "priority": mostly(st.integers(-5, 5)),
        "metadata": mostly(st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2)),
    }
    bodies = st.fixed_dictionaries(
        {
            "input": mostly(st.one_of(texts, st.lists(item, min_size=1, max_size=2))),
            "max_output_tokens": mostly(st.integers(1, 4)),
        },
        optional=fields,
    )

    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(bodies)
    def run(body):
        if body["max_output_tokens"] is None:  # the rest of the context: up to a thousand tokens
            body = {**body, "max_output_tokens": 4}
        try:
            content = json.dumps(body)
        except (ValueError, TypeError):
            return
        if isinstance(body.get("max_output_tokens"), int) and body["max_output_tokens"] > 4:
            return  # valid and long: costs time, proves nothing more
        with HTTP.stream(
            "POST",
            server.base + "/v1/responses",
            content=content,
            headers={"Content-Type": "application/json"},
            timeout=120,
        ) as r:
            text = "".join(r.iter_text())
        assert r.status_code < 500, (body, text)
        assert "InternalServerError" not in text, (body, text)

    run()
    assert server.healthy()
    server.wait_idle()
