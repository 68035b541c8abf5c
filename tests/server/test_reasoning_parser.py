"""--reasoning-parser on a real server, driven by the openai SDK, over a tiny Qwen 3 checkpoint that
thinks on cue (tests/scripted_thinker.py: greedy, it answers "<think>hm</think>OK"):

- the reply carries `reasoning` apart from `content`, streamed or not, the same either way, and the
  usage counts the reasoning tokens (vLLM's fields);
- `include_reasoning: false` leaves the reasoning out, with the logprobs and token ids that spell it;
- `thinking_token_budget` forces the end of reasoning after so many of its tokens;
- `enable_thinking: false` (and a prompt whose template closed the reasoning): all content;
- a grammar (structured outputs, a required tool call) constrains the answer, not the reasoning;
- auto tool calls are parsed from the answer, and a Qwen 3 call that skips "</think>" ends the
  reasoning;
- /v1/responses makes a reasoning item before the message, streamed or not, and takes it back as
  input (vLLM's shapes); an earlier reasoning reaches the chat template;
- Gemma 4's channel and its calls through the `gemma4` parsers (tests/scripted_gemma4.py);
- after it all, every KV block is free."""

from __future__ import annotations

import json

import openai
import pytest

from ..scripted_gemma4 import write_scripted_gemma4
from ..scripted_thinker import write_scripted_thinker
from . import gemma4_parser_cases as gemma4

pytestmark = pytest.mark.slow(seconds=20)
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(make_server, tmp_path_factory):
    folder = write_scripted_thinker(tmp_path_factory.mktemp("thinker") / "model")
    return make_server(
        "--model",
        str(folder),
        "--served-model-name",
        "thinker",
        "--reasoning-parser",
        "qwen3",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    )


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", timeout=60, max_retries=0)


def chat(client, **fields):
    return client.chat.completions.create(model="thinker", messages=fields.pop("messages", HI), temperature=0, **fields)


def streamed(client, **fields) -> tuple[str, str, str | None, list]:
    """(reasoning, content, finish_reason, tool call deltas) accumulated from a stream, and the
    usage of its last chunk checked against the reasoning tokens."""
    reasoning = content = ""
    finish, calls, usage = None, [], None
    for chunk in chat(client, stream=True, stream_options={"include_usage": True}, **fields):
        usage = chunk.usage or usage
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning", None) or ""
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    return reasoning, content, finish, calls, usage


def test_reasoning_comes_apart_from_the_answer_streamed_or_not(server, client):
    res = chat(client, logprobs=True, extra_body={"return_token_ids": True})
    msg, choice = res.choices[0].message, res.choices[0]
    assert (msg.reasoning, msg.content, choice.finish_reason) == ("hm", "OK", "stop")
    # <think> h m </think> O K and EOS: two of reasoning
    assert res.usage.completion_tokens == 7 and res.usage.completion_tokens_details.reasoning_tokens == 2
    assert len(choice.logprobs.content) == 7 and len(choice.model_extra["token_ids"]) == 7
    reasoning, content, finish, _, usage = streamed(client)
    assert (reasoning, content, finish) == ("hm", "OK", "stop")
    assert usage.completion_tokens_details.reasoning_tokens == 2
    server.wait_idle()


def test_include_reasoning_false_leaves_it_out_with_what_would_spell_it(server, client):
    res = chat(client, logprobs=True, extra_body={"include_reasoning": False, "return_token_ids": True})
    choice = res.choices[0]
    assert (choice.message.reasoning, choice.message.content) == (None, "OK")
    assert choice.logprobs is None and choice.model_extra.get("token_ids") is None
    reasoning, content, _, _, _ = streamed(client, logprobs=True, extra_body={"include_reasoning": False})
    assert (reasoning, content) == ("", "OK")
    server.wait_idle()


def test_no_thinking_asked_is_all_answer(server, client):
    """The template closes the reasoning in the prompt; this model writes its markers anyway,
    and they are content."""
    res = chat(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert (res.choices[0].message.reasoning, res.choices[0].message.content) == (None, "<think>hm</think>OK")
    assert res.usage.completion_tokens_details.reasoning_tokens == 0
    reasoning, content, _, _, _ = streamed(client, reasoning_effort="none")  # sets enable_thinking=False
    assert (reasoning, content) == ("", "<think>hm</think>OK")
    server.wait_idle()


OK_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
JSON_OK = {"type": "json_schema", "json_schema": {"name": "r", "schema": OK_SCHEMA}}


def test_a_grammar_constrains_the_answer_not_the_reasoning(server, client):
    fmt = JSON_OK
    res = chat(client, response_format=fmt, max_tokens=40)
    assert res.choices[0].message.reasoning == "hm"  # free: the grammar would not allow "hm"
    assert json.loads(res.choices[0].message.content).keys() == {"ok"}
    reasoning, content, _, _, _ = streamed(client, response_format=fmt, max_tokens=40)
    assert (reasoning, content) == ("hm", res.choices[0].message.content)
    # not thinking: constrained from the first token
    res = chat(client, response_format=fmt, max_tokens=40, reasoning_effort="none")
    assert res.choices[0].message.reasoning is None and json.loads(res.choices[0].message.content).keys() == {"ok"}
    server.wait_idle()


TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


def test_tool_calls_come_from_the_answer(server, client):
    required = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=60)
    (call,) = required.choices[0].message.tool_calls
    assert call.function.name == "get_time" and required.choices[0].message.reasoning == "hm"
    assert required.choices[0].finish_reason == "tool_calls"
    # auto: the answer forced into a hermes call; the reasoning stays reasoning
    forced = {"structured_outputs": {"regex": r'<tool_call>\{"name": "get_time"\}</tool_call>'}}
    auto = chat(client, tools=TOOLS, max_tokens=64, extra_body=forced)
    msg = auto.choices[0].message
    assert msg.reasoning == "hm" and [c.function.name for c in msg.tool_calls] == ["get_time"]
    reasoning, content, finish, calls, _ = streamed(client, tools=TOOLS, max_tokens=64, extra_body=forced)
    assert reasoning == "hm" and finish == "tool_calls" and [c.function.name for c in calls] == ["get_time"]
    server.wait_idle()


def test_a_qwen3_call_without_the_end_ends_the_reasoning(server, client):
    """Continuing a reply that ends in "?", this model writes "<tool_call>" at once: the call is
    the answer's, not reasoning (Qwen 3's rule), and the grammar of a named call begins there."""
    msgs = [*HI, {"role": "assistant", "content": "Hmm?"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    res = chat(client, messages=msgs, extra_body=extra, max_tokens=8)
    assert (res.choices[0].message.reasoning, res.choices[0].message.content) == (None, "<tool_call>")
    assert res.usage.completion_tokens_details.reasoning_tokens == 0
    forced = {**extra, "structured_outputs": {"regex": "<tool_call>x"}}
    res = chat(client, messages=msgs, extra_body=forced, max_tokens=8)
    assert (res.choices[0].message.reasoning, res.choices[0].message.content) == (None, "<tool_call>x")
    server.wait_idle()


def test_a_thinking_budget_forces_the_end_of_reasoning(server, client):
    """vLLM's `thinking_token_budget`: after that many reasoning tokens the end is forced, and the
    model answers from there; -1 is no limit. With n > 1 each sequence counts its own."""
    for budget, reasoning, n in ((0, None, 1), (1, "h", 2), (2, "hm", 1), (-1, "hm", 1)):
        res = chat(client, n=n, extra_body={"thinking_token_budget": budget})
        for c in res.choices:
            assert (c.message.reasoning, c.message.content) == (reasoning, "OK"), budget
        assert res.usage.completion_tokens_details.reasoning_tokens == n * len(reasoning or "")
    streamed_reasoning, content, _, _, _ = streamed(client, extra_body={"thinking_token_budget": 1})
    assert (streamed_reasoning, content) == ("h", "OK")
    # with a grammar after the reasoning, and on /v1/completions (the prompt says where it thinks)
    res = chat(client, response_format=JSON_OK, max_tokens=40, extra_body={"thinking_token_budget": 1})
    assert res.choices[0].message.reasoning == "h" and json.loads(res.choices[0].message.content).keys() == {"ok"}
    done = client.completions.create(
        model="thinker",
        prompt="<|im_start|>assistant\n",
        max_tokens=8,
        temperature=0,
        extra_body={"thinking_token_budget": 0},
    )
    assert done.choices[0].text == "</think>OK"
    for bad in (-2, 1.5, "3"):
        with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
            chat(client, extra_body={"thinking_token_budget": bad})
    server.wait_idle()


def test_responses_make_a_reasoning_item_streamed_or_not(server, client):
    res = client.responses.create(model="thinker", input="Hi", max_output_tokens=8)
    assert [i.type for i in res.output] == ["reasoning", "message"]
    assert res.output[0].content[0].text == "hm" and res.output_text == "OK"
    assert res.usage.output_tokens_details.reasoning_tokens == 2
    kinds, thought, answer, done = [], "", "", None
    with client.responses.stream(model="thinker", input="Hi", max_output_tokens=8) as stream:
        for e in stream:
            kinds.append(e.type)
            thought += e.delta if e.type == "response.reasoning_text.delta" else ""
            answer += e.delta if e.type == "response.output_text.delta" else ""
        done = stream.get_final_response()
    assert (thought, answer) == ("hm", "OK")
    assert [i.type for i in done.output] == ["reasoning", "message"] and done.output[0].content[0].text == "hm"
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    hidden = client.responses.create(
        model="thinker", input="Hi", max_output_tokens=8, extra_body={"include_reasoning": False}
    )
    assert [i.type for i in hidden.output] == ["message"] and hidden.output_text == "OK"
    # the next turn hands the reasoning back: as an item, or by previous_response_id
    chained = client.responses.create(
        model="thinker",
        input=[{"role": "user", "content": "Hi"}, *res.output, {"role": "user", "content": "Again"}],
        max_output_tokens=8,
    )
    again = client.responses.create(model="thinker", input="Again", previous_response_id=res.id, max_output_tokens=8)
    assert chained.output_text == again.output_text == "OK"
    assert chained.usage.input_tokens == again.usage.input_tokens
    server.wait_idle()


def test_an_earlier_reasoning_reaches_the_template_under_both_names(tmp_path, make_server):
    """As vLLM: an assistant message's `reasoning` (or `reasoning_content`) is handed to the
    template as both, for templates that interleave thinking with tool calls."""
    folder = write_scripted_thinker(tmp_path / "model")
    server = make_server("--model", str(folder), "--served-model-name", "thinker")
    tpl = "{% for m in messages %}[{{ m.reasoning }}|{{ m.reasoning_content }}]{% endfor %}"
    ids = {}
    for key in ("reasoning", "reasoning_content"):
        msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "OK", key: "hm"}]
        r = server.http.post(
            server.base + "/v1/chat/completions",
            json={"messages": msgs, "chat_template": tpl, "max_tokens": 1, "return_token_ids": True},
        )
        assert r.status_code == 200, r.text
        ids[key] = r.json()["prompt_token_ids"]
    assert ids["reasoning"] == ids["reasoning_content"]
    r = server.http.post(server.base + "/detokenize", json={"tokens": ids["reasoning"]})
    assert r.json()["prompt"] == "[|][hm|hm]"


def test_markers_that_are_special_tokens_are_read_too(make_server, tmp_path):
    """Decoding skips special tokens unless asked; with the parser on, the markers stay in the
    text it splits (as a reply's content shows)."""
    folder = write_scripted_thinker(tmp_path / "model", special_markers=True)
    server = make_server("--model", str(folder), "--served-model-name", "thinker", "--reasoning-parser", "deepseek_r1")
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="none", timeout=60, max_retries=0)
    msg = chat(client).choices[0].message
    assert (msg.reasoning, msg.content) == ("hm", "OK")
    reasoning, content, _, _, usage = streamed(client)
    assert (reasoning, content, usage.completion_tokens_details.reasoning_tokens) == ("hm", "OK", 2)
    server.wait_idle()


def test_a_model_without_the_markers_is_refused_at_start(make_server):
    with pytest.raises(RuntimeError, match="the tokenizer has no '<think>' token"):
        make_server("--reasoning-parser", "deepseek_r1")


def test_gemma4_reasons_in_a_channel_and_calls_a_tool(make_server, tmp_path):
    """Gemma 4's markers (special tokens) through both of its parsers: the reply opens its own
    channel ("<|channel>thought\\nhm<channel|>"), then calls get_weather with days 42, typed by
    the tool's schema; streamed or not alike; a grammar constrains the answer after the channel;
    a thinking budget is refused by name, since this model opens its reasoning mid-reply."""
    folder = write_scripted_gemma4(tmp_path / "model")
    server = make_server(
        "--model",
        str(folder),
        "--served-model-name",
        "thinker",
        "--reasoning-parser",
        "gemma4",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "gemma4",
    )
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="none", timeout=60, max_retries=0)
    res = chat(client, tools=gemma4.TOOLS, max_tokens=32)
    msg, choice = res.choices[0].message, res.choices[0]
    assert (msg.reasoning, msg.content, choice.finish_reason) == ("hm", None, "tool_calls")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"days": 42})
    ]
    # <|channel> thought\n h m <channel|> <|tool_call> call:get_weather{days: 4 2 } <tool_call|> <turn|>
    assert res.usage.completion_tokens == 12 and res.usage.completion_tokens_details.reasoning_tokens == 3
    reasoning, content, finish, calls, usage = streamed(client, tools=gemma4.TOOLS, max_tokens=32)
    assert (reasoning, content, finish) == ("hm", "", "tool_calls")
    assert [c.function.name for c in calls if c.function.name] == ["get_weather"]
    assert json.loads("".join(c.function.arguments or "" for c in calls)) == {"days": 42}
    assert usage.completion_tokens_details.reasoning_tokens == 3
    # without tools the call is the answer's text
    plain = chat(client, max_tokens=32).choices[0].message
    assert (plain.reasoning, plain.content) == ("hm", "<|tool_call>call:get_weather{days:42}<tool_call|>")
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        chat(client, max_tokens=8, extra_body={"thinking_token_budget": 2})
    # a grammar constrains the answer alone: the channel runs free, then "ab" where the call was
    forced = chat(client, max_tokens=16, extra_body={"structured_outputs": {"regex": "ab"}})
    assert (forced.choices[0].message.reasoning, forced.choices[0].message.content) == ("hm", "ab")
    # /v1/responses: a reasoning item, then the call as a function_call item
    tools = [{"type": "function", **t["function"]} for t in gemma4.TOOLS]
    res = client.responses.create(model="thinker", input="Hi", tools=tools, max_output_tokens=32)
    assert [i.type for i in res.output] == ["reasoning", "function_call"]
    assert res.output[0].content[0].text == "hm" and res.output[1].name == "get_weather"
    assert json.loads(res.output[1].arguments) == {"days": 42}
    server.wait_idle()
