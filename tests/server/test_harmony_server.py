"""gpt-oss's harmony replies served with `--reasoning-parser openai_gptoss --tool-call-parser openai`
(vLLM's flags for it), driven by the openai SDK over a scripted checkpoint
(tests/scripted_harmony.py): the analysis channel comes back as `reasoning`, the final channel as
`content`, a commentary message to a function as a tool call, streamed or not alike; /v1/responses
makes its reasoning item; what cannot be had with harmony is refused by name; after it all every
KV block is free."""

from __future__ import annotations

import argparse
import json

import openai
import pytest

from prefixkv.server.launch import check_server_args

from ..scripted_harmony import write_scripted_harmony

pytestmark = pytest.mark.slow(seconds=15)
HI = [{"role": "user", "content": "Hi"}]
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


@pytest.fixture(scope="module")
def server(make_server, tmp_path_factory):
    folder = write_scripted_harmony(tmp_path_factory.mktemp("harmony") / "model")
    return make_server(
        "--model",
        str(folder),
        "--served-model-name",
        "oss",
        "--reasoning-parser",
        "openai_gptoss",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "openai",
    )


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", timeout=60, max_retries=0)


def chat(client, **fields):
    return client.chat.completions.create(model="oss", messages=fields.pop("messages", HI), temperature=0, **fields)


def streamed(client, **fields):
    reasoning = content = ""
    finish, calls = None, []
    for chunk in chat(client, stream=True, **fields):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning", None) or ""
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    return reasoning, content, finish, calls


def test_channels_come_apart_streamed_or_not(server, client):
    res = chat(client)
    msg, choice = res.choices[0].message, res.choices[0]
    assert (msg.reasoning, msg.content, choice.finish_reason) == ("hm", "OK", "stop")
    assert streamed(client) == ("hm", "OK", "stop", [])
    hidden = chat(client, extra_body={"include_reasoning": False}).choices[0].message
    assert (getattr(hidden, "reasoning", None), hidden.content) == (None, "OK")
    server.wait_idle()


def test_a_commentary_message_to_a_function_is_a_tool_call(server, client):
    res = chat(client, tools=[WEATHER])
    msg, choice = res.choices[0].message, res.choices[0]
    assert msg.reasoning == "Need weather." and not msg.content and choice.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    reasoning, content, finish, calls = streamed(client, tools=[WEATHER])
    assert (reasoning, content, finish) == ("Need weather.", "", "tool_calls")
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]
    server.wait_idle()


def test_responses_make_a_reasoning_item_and_function_calls(server, client):
    res = client.responses.create(model="oss", input="Hi", temperature=0)
    kinds = [item.type for item in res.output]
    assert kinds == ["reasoning", "message"] and res.output_text == "OK"
    assert res.output[0].content[0].text == "hm"
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    res = client.responses.create(model="oss", input="Weather?", temperature=0, tools=[tool])
    assert [item.type for item in res.output] == ["reasoning", "function_call"]
    assert (res.output[1].name, res.output[1].arguments) == ("get_weather", '{"city": "Paris"}')
    server.wait_idle()


def test_a_grammar_constrains_the_final_channel_only(server, client):
    """The analysis runs free ("hm"); the final channel's body, "OK" unconstrained, is the schema's."""
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "maxItems": 0}}}
    res = chat(client, response_format=schema)
    msg = res.choices[0].message
    assert msg.reasoning == "hm" and json.loads(msg.content) == []
    server.wait_idle()


def test_what_harmony_cannot_take_is_refused_by_name(server, client):
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        chat(client, extra_body={"thinking_token_budget": 4})
    args = argparse.Namespace(enable_auto_tool_choice=True, tool_call_parser="openai", reasoning_parser=None)
    with pytest.raises(SystemExit, match="--reasoning-parser openai_gptoss"):
        check_server_args(args)
    server.wait_idle()


def test_an_earlier_turns_reasoning_reaches_the_template_as_thinking(server):
    """gpt-oss's template renders a tool-call turn's analysis from `thinking`: a client's
    `reasoning` gets there."""
    import httpx

    messages = [*HI, {"role": "assistant", "content": "OK", "reasoning": "pondered"}, *HI]
    body = {"model": "oss", "messages": messages}
    res = httpx.post(server.base + "/tokenize", json=body, timeout=30).json()
    text = httpx.post(server.base + "/detokenize", json={"model": "oss", "tokens": res["tokens"]}, timeout=30).json()
    assert "<|channel|>analysis<|message|>pondered<|end|>" in text["prompt"]
