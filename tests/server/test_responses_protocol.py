"""The Responses API's translations alone, no model: input items -> chat messages, flat tools and
choices -> chat's, refusals by name, and the stored responses' LRU bound."""

from __future__ import annotations

import pytest

from prefixkv.server.errors import APIError
from prefixkv.server.responses_protocol import (
    ResponsesRequest,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    input_messages,
)
from prefixkv.server.responses_store import (
    ResponseStore,
    StoredResponse,
    max_stored_bytes_from_env,
    max_stored_from_env,
)


def test_input_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "It is sunny."}]},
    ]
    messages = input_messages(items)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[1]["content"] == [{"type": "text", "text": "Weather?"}]
    # the calls of one turn are one assistant message
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}
    assert input_messages("Hi") == [{"role": "user", "content": "Hi"}]


def test_reasoning_items_join_the_assistant_message_beside_them():
    """vLLM's rule: a reasoning item is the reasoning of the assistant message it precedes (or
    follows, when that has none yet); its content's text, else its summary's."""
    think = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]}
    answer = {"role": "assistant", "content": [{"type": "output_text", "text": "OK"}]}
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    user = {"role": "user", "content": "Hi"}
    assert input_messages([user, think, answer]) == [
        user,
        {"role": "assistant", "content": [{"type": "text", "text": "OK"}], "reasoning": "hm"},
    ]
    assert input_messages([user, think, call])[1] == {
        "role": "assistant",
        "content": "",
        "reasoning": "hm",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }
    summary = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "short"}]}
    assert input_messages([user, answer, summary])[1]["reasoning"] == "short"  # after its answer
    assert input_messages([user, think])[1] == {"role": "assistant", "content": "", "reasoning": "hm"}


@pytest.mark.parametrize(
    "items",
    [
        [],
        [{"type": "reasoning", "summary": [], "encrypted_content": "gAAAA"}],
        [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": 3}]}],
        [{"type": "item_reference", "id": "msg_1"}],
        [{"role": "tool", "content": "x"}],
        [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}],
        [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}],
        [{"type": "function_call", "name": "f"}],
        ["not an item"],
    ],
)
def test_unsupported_items_are_refused(items):
    with pytest.raises(APIError) as e:
        input_messages(items)
    assert e.value.status == 400 and e.value.param == "input"


def test_tools_choices_and_formats():
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}]
    assert chat_tools(tools) == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}
    ]
    with pytest.raises(APIError, match="web_search"):
        chat_tools([{"type": "web_search"}])
    assert chat_tool_choice({"type": "function", "name": "f"}) == {"type": "function", "function": {"name": "f"}}
    assert chat_tool_choice("required") == "required"
    fmt = {"type": "json_schema", "name": "city", "schema": {"type": "object"}, "strict": True}
    assert chat_response_format({"format": fmt}) == {
        "type": "json_schema",
        "json_schema": {"name": "city", "schema": {"type": "object"}, "strict": True},
    }
    assert chat_response_format(None) is None
    with pytest.raises(APIError) as e:
        chat_response_format({"format": {"type": "grammar"}})
    assert e.value.param == "text.format"


def test_refusals_name_the_field():
    def names(**fields):
        return [n for n, _ in ResponsesRequest(input="Hi", **fields).refusals()]

    assert names(store=False, metadata={"a": "b"}, user="u", background=False, include=[], truncation="disabled") == []
    assert names(include=["message.output_text.logprobs"], top_logprobs=3) == []
    assert names(background=True) == ["background"]
    assert names(top_logprobs=3) == ["top_logprobs"]
    assert names(include=["file_search_call.results"]) == ["include"]
    assert names(text={"format": {"type": "text"}, "verbosity": "low"}) == ["text.verbosity"]
    assert names(reasoning={"effort": "low", "summary": None}) == []  # effort goes to the template
    assert names(reasoning={"effort": "low", "summary": "auto"}, frobnicate=1) == ["frobnicate", "reasoning.summary"]
    assert names(reasoning=None) == []  # null is not sent


def test_truncation_keeps_the_longest_tail_that_fits():
    """The bisection alone: an admission that fits up to a number of characters stands in for the
    chat admission's token count."""
    import asyncio

    from prefixkv.server.responses import OpenAIServingResponses

    class Sized(OpenAIServingResponses):
        def __init__(self, limit: int) -> None:
            self.limit, self.tries = limit, 0

        async def admit(self, req, messages):
            self.tries += 1
            size = sum(len(m["content"]) for m in messages)
            if size > self.limit:
                raise APIError(f"This model's maximum context length is {self.limit} tokens.", 400, param="prompt")
            return [size], (), None, None

    def msg(role: str, n: int) -> dict:
        return {"role": role, "content": "x" * n}

    system = [msg("system", 5)]
    conversation = [msg("user", 50), msg("assistant", 10), msg("tool", 10), msg("user", 30), msg("user", 20)]
    req = ResponsesRequest(input="x", truncation="auto")
    for limit, kept in [(75, 1), (80, 1), (70, 3), (55, 3), (54, 4), (25, 4)]:
        serving = Sized(limit)
        tail, (ids, *_) = asyncio.run(serving.admit_truncated(req, system, conversation))
        assert tail == conversation[kept:] and ids == [5 + sum(len(m["content"]) for m in tail)]
    # a tail never starts at a tool result: within 70 it would fit from the tool result on (65)
    tail, _ = asyncio.run(Sized(70).admit_truncated(req, system, conversation))
    assert tail[0]["role"] == "user" and len(tail) == 2
    long_chain = [msg("user", 10) for _ in range(1000)]
    serving = Sized(105)
    tail, _ = asyncio.run(serving.admit_truncated(req, system, long_chain))
    assert len(tail) == 10 and serving.tries <= 12  # bisection: a few tries, not one per message
    with pytest.raises(APIError, match="maximum context length"):  # too long even alone
        asyncio.run(Sized(10).admit_truncated(req, system, conversation))


def test_store_keeps_the_most_recently_used(monkeypatch):
    store = ResponseStore(2)
    for rid in ("a", "b"):
        store.put(rid, StoredResponse({"id": rid}, [], None))
    assert store.get("a") is not None  # a is now the most recent: b goes first
    store.put("c", StoredResponse({"id": "c"}, [], None))
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    assert store.delete("a") and not store.delete("a")
    none = ResponseStore(0)
    none.put("x", StoredResponse({}, [], None))
    assert none.get("x") is None
    # the byte bound: characters of every string held; an entry over it alone is not kept
    small = ResponseStore(100, max_bytes=300)
    for rid in "abc":
        assert small.put(rid, StoredResponse({"id": rid}, [{"role": "user", "content": "x" * 80}], None))
    assert small.get("a") is None and small.get("c") is not None and small.size <= 300
    assert not small.put("big", StoredResponse({}, [{"role": "user", "content": "x" * 400}], None))
    assert small.get("big") is None
    small.delete("b")
    small.delete("c")
    assert small.size == 0
    monkeypatch.setenv("PREFIXKV_RESPONSES_MAX_STORED", "7")
    assert max_stored_from_env() == 7
    monkeypatch.setenv("PREFIXKV_RESPONSES_MAX_STORED", "-1")
    with pytest.raises(ValueError, match="PREFIXKV_RESPONSES_MAX_STORED"):
        max_stored_from_env()
    monkeypatch.setenv("PREFIXKV_RESPONSES_MAX_STORED_BYTES", "1M")
    with pytest.raises(ValueError, match="PREFIXKV_RESPONSES_MAX_STORED_BYTES"):
        max_stored_bytes_from_env()
