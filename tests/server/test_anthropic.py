"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) on a real server, driven by
Anthropic's own SDK, over the scripted thinker (tests/scripted_thinker.py: greedy, it answers
"<think>hm</think>OK") with --reasoning-parser qwen3:

- the reply's blocks: thinking, then text; streamed as Anthropic's events, the same in the end;
- stop reasons: end_turn, max_tokens, stop_sequence, tool_use; usage (input, output, cache read);
- thinking disabled / enabled with a budget; output_config's JSON schema;
- tools: a forced call as a tool_use block (streamed as input_json_delta), and the turn after it
  (the thinking and tool_use blocks sent back, a tool_result) rendered;
- count_tokens; the SDK's x-api-key; Anthropic's error shape; every KV block free after."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from ..scripted_thinker import write_scripted_thinker

pytestmark = pytest.mark.slow(seconds=20)
KEY = "sk-test-anthropic"
HI = [{"role": "user", "content": "Hi"}]
TIME = {"name": "get_time", "description": "The time", "input_schema": {"type": "object", "properties": {}}}


@pytest.fixture(scope="module")
def server(make_server, tmp_path_factory):
    folder = write_scripted_thinker(tmp_path_factory.mktemp("thinker") / "model")
    return make_server(
        *("--model", str(folder), "--served-model-name", "thinker", "--reasoning-parser", "qwen3"),
        *("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--api-key", KEY),
    )


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0, timeout=60)


def create(client, **fields):
    return client.messages.create(model="thinker", max_tokens=fields.pop("max_tokens", 16), messages=HI, **fields)


def streamed(client, **fields):
    """(the event types in order, the final message the SDK assembled from them)."""
    kinds = []
    with client.messages.stream(model="thinker", max_tokens=fields.pop("max_tokens", 16), messages=HI, **fields) as s:
        for e in s:
            kinds.append(e.type)
        return kinds, s.get_final_message()


def blocks(message) -> list[tuple[str, str]]:
    out = []
    for b in message.content:
        text = {"thinking": getattr(b, "thinking", None), "text": getattr(b, "text", None)}.get(b.type)
        out.append((b.type, text if text is not None else json.dumps(getattr(b, "input", None))))
    return out


def test_a_reply_has_its_thinking_and_its_text_streamed_or_not(server, client):
    msg = create(client, system="Be brief.")
    assert msg.id.startswith("msg_") and (msg.type, msg.role, msg.model) == ("message", "assistant", "thinker")
    assert blocks(msg) == [("thinking", "hm"), ("text", "OK")] and msg.content[0].signature
    assert (msg.stop_reason, msg.stop_sequence) == ("end_turn", None)
    assert msg.usage.output_tokens == 7 and msg.usage.input_tokens > 0 and msg.usage.cache_read_input_tokens >= 0
    kinds, final = streamed(client, system="Be brief.")
    assert blocks(final) == blocks(msg) and final.stop_reason == "end_turn"
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 2
    assert final.usage.output_tokens == 7
    # the same prompt again: its blocks are read from the prefix cache
    again = create(client, system="Be brief.")
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == msg.usage.input_tokens + (
        msg.usage.cache_read_input_tokens or 0
    )
    server.wait_idle()


def test_stop_reasons_and_thinking_settings(server, client):
    assert create(client, max_tokens=2).stop_reason == "max_tokens"
    stopped = create(client, stop_sequences=["K"])
    assert (stopped.stop_reason, stopped.stop_sequence, blocks(stopped)) == (
        "stop_sequence",
        "K",
        [("thinking", "hm"), ("text", "O")],
    )
    # disabled: the template is told not to think (the scripted model writes its markers anyway: text)
    assert blocks(create(client, thinking={"type": "disabled"})) == [("text", "<think>hm</think>OK")]
    budget = create(client, thinking={"type": "enabled", "budget_tokens": 1})
    assert blocks(budget) == [("thinking", "h"), ("text", "OK")]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    shaped = create(
        client, max_tokens=40, extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}}
    )
    assert shaped.content[0].thinking == "hm" and json.loads(shaped.content[1].text).keys() == {"ok"}
    server.wait_idle()


def test_a_tool_call_and_the_turn_after_it(server, client):
    choice = {"type": "tool", "name": "get_time"}
    msg = create(client, tools=[TIME], tool_choice=choice, max_tokens=40)
    assert [b.type for b in msg.content] == ["thinking", "tool_use"] and msg.stop_reason == "tool_use"
    call = msg.content[1]
    assert call.name == "get_time" and call.input == {} and call.id
    kinds, final = streamed(client, tools=[TIME], tool_choice=choice, max_tokens=40)
    assert [b.type for b in final.content] == ["thinking", "tool_use"] and final.content[1].input == {}
    assert final.stop_reason == "tool_use"
    # the next turn sends the assistant's blocks back with the result: it renders and runs
    turn = [
        *HI,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "12:00"}]},
    ]
    after = client.messages.create(model="thinker", max_tokens=16, messages=turn, tools=[TIME])  # auto
    assert blocks(after) == [("thinking", "hm"), ("text", "OK")] and after.stop_reason == "end_turn"
    plain = client.messages.count_tokens(model="thinker", messages=turn)
    with_tools = client.messages.count_tokens(model="thinker", messages=turn, tools=[TIME])
    assert 0 < plain.input_tokens < with_tools.input_tokens
    # a generation field changes no count: refused by name, not ignored
    r = httpx.post(
        server.base + "/v1/messages/count_tokens",
        json={"model": "thinker", "messages": turn, "temperature": 0.5},
        headers={"x-api-key": KEY},
    )
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
    # what the template got: the chat messages the blocks stand for (reasoning and a call on the
    # assistant turn, the result as a tool turn), by chat's own route
    fn = {"name": "get_time", "arguments": "{}"}
    chat_turn = [
        *HI,
        {
            "role": "assistant",
            "content": "",
            "reasoning": "hm",
            "tool_calls": [{"id": call.id, "type": "function", "function": fn}],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"},
    ]
    auth = {"x-api-key": KEY}
    tokens = httpx.post(server.base + "/tokenize", json={"messages": chat_turn}, headers=auth).json()
    assert tokens["count"] == plain.input_tokens
    text = httpx.post(server.base + "/detokenize", json={"tokens": tokens["tokens"]}, headers=auth).json()["prompt"]
    assert '<think>hm</think><tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>' in text and "12:00" in text
    server.wait_idle()


def test_refusals_and_errors_have_anthropics_shape(server, client):
    for fields, match in (
        ({"extra_body": {"container": "c"}}, "container"),
        ({"extra_body": {"mcp_servers": [{"url": "x"}]}}, "mcp_servers"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search"),
    ):
        with pytest.raises(anthropic.BadRequestError, match=match) as e:
            create(client, **fields)
        assert e.value.body["error"]["type"] == "invalid_request_error"
    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    with pytest.raises(anthropic.BadRequestError, match="not fetched"):
        client.messages.create(model="thinker", max_tokens=4, messages=[{"role": "user", "content": [image]}])
    r = httpx.post(server.base + "/v1/messages", json={"model": "thinker", "messages": HI}, headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["type"] == "error" and "max_tokens" in r.json()["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="other", max_tokens=4, messages=HI)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.base, api_key="wrong", max_retries=0).messages.create(
            model="thinker", max_tokens=4, messages=HI
        )
    # metadata changes nothing here: accepted, logged once
    assert blocks(create(client, metadata={"user_id": "u1"})) == [("thinking", "hm"), ("text", "OK")]
    create(client, metadata={"user_id": "u2"})
    assert server.output().count("request field 'metadata' accepted") == 1
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    assert blocks(create(client, system=system)) == blocks(create(client, system="Be brief."))
    cached_tool = {**TIME, "cache_control": {"type": "ephemeral"}}
    assert create(client, tools=[cached_tool], tool_choice={"type": "none"}).stop_reason == "end_turn"
    assert server.output().count("request field 'cache_control' accepted") == 1
    assert blocks(create(client, thinking={"type": "adaptive"})) == [("thinking", "hm"), ("text", "OK")]
    assert server.output().count("request field 'thinking.adaptive' accepted") == 1
    for fields, match in (
        ({"tools": [{**TIME, "defer_loading": True}]}, "defer_loading"),
        ({"thinking": {"type": "enabled", "budget_tokens": 8, "display": "omitted"}}, "display"),
    ):
        with pytest.raises(anthropic.BadRequestError, match=match):
            create(client, **fields)
    server.wait_idle()
