"""Tool calling on /v1/chat/completions, in-process: named and required choices are constrained so
the call always parses (its arguments validate against the tool's schema), "auto" parses the
model's hermes-format text (forced here with a regex so a 135M model writes one), streamed
deltas carry the same calls, and the refusals are vLLM's. The parsers alone on known texts."""

from __future__ import annotations

import json

import jsonschema
import pytest
from starlette.testclient import TestClient

from prefixkv.server.tools import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    ToolPlan,
    ToolStream,
)

from . import gemma4_parser_cases as gemma4

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]},
        },
    },
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


@pytest.fixture(scope="module")
def engine(default_lm):
    from prefixkv.config import EngineConfig
    from prefixkv.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(dtype="float32", device="cpu", num_blocks=96, max_model_len=1024), loaded=default_lm)


@pytest.fixture(scope="module")
def client(engine):
    from prefixkv.server.app import create_app

    with TestClient(create_app(engine, tool_call_parser="hermes")) as c:
        yield c


@pytest.fixture(autouse=True)
def blocks_free_after(engine):
    yield
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


def chat(client, **fields) -> dict:
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 48, "temperature": 0, **fields}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def stream(client, **fields) -> tuple[list[dict], str | None, str]:
    """(tool calls accumulated from the deltas, last finish_reason, content)."""
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 48, "temperature": 0, "stream": True, **fields}
    calls: dict[int, dict] = {}
    finish, content = None, ""
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                delta = choice["delta"]
                content += delta.get("content") or ""
                for tc in delta.get("tool_calls") or []:
                    call = calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": "", "deltas": 0})
                    call["deltas"] += 1
                    call["id"] = tc.get("id") or call["id"]
                    call["name"] += (tc.get("function") or {}).get("name") or ""
                    call["arguments"] += (tc.get("function") or {}).get("arguments") or ""
                finish = choice.get("finish_reason") or finish
    return [calls[i] for i in sorted(calls)], finish, content


def test_named_and_required_choices_always_parse(client):
    named = chat(client, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = named["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
    assert named["finish_reason"] == "stop" and named["message"]["content"] is None
    required = chat(client, tool_choice="required", parallel_tool_calls=False)
    assert required["finish_reason"] == "tool_calls", required
    (call,) = required["message"]["tool_calls"]
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call["function"]["name"]]
    jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
    # streamed: the same call
    calls, finish, content = stream(client, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert len(calls) == 1 and calls[0]["id"].startswith("chatcmpl-tool-") and calls[0]["deltas"] > 3  # as generated
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", named["message"]["tool_calls"][0]["function"]["arguments"])
    ]
    assert finish == "stop" and content == ""


def test_auto_parses_the_models_hermes_text(client):
    call = '{"name": "get_time"}'  # no arguments: "{}"
    forced = {"regex": r"Ok\. <tool_call>" + call.replace("{", r"\{").replace("}", r"\}") + "</tool_call>"}
    auto = chat(client, structured_outputs=forced, max_tokens=64)
    assert auto["finish_reason"] == "tool_calls" and auto["message"]["content"] == "Ok."
    (parsed,) = auto["message"]["tool_calls"]
    assert parsed["function"]["name"] == "get_time" and json.loads(parsed["function"]["arguments"]) == {}
    calls, finish, content = stream(client, structured_outputs=forced, max_tokens=64)
    assert content == "Ok. " and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_time", "{}")]
    # no call in the text: plain content, nothing parsed
    plain = chat(client, max_tokens=4)
    assert plain["message"]["tool_calls"] is None and plain["finish_reason"] == "length" and plain["message"]["content"]
    assert chat(client, tool_choice="none", max_tokens=2)["message"]["tool_calls"] is None


def test_auto_parses_qwen3_xml_calls_with_typed_arguments(engine):
    """--tool-call-parser qwen3_coder: the model's XML call (forced with a regex here) comes out as
    a call whose arguments have the tool's types, streamed or not."""
    from prefixkv.server.app import create_app

    days = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "forecast", "parameters": days}}]
    text = (
        "<tool_call>\n<function=forecast>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
    )
    forced = {"regex": "Ok\\. " + text.replace("\n", "\\n") + "</function>\\n</tool_call>"}
    with TestClient(create_app(engine, tool_call_parser="qwen3_coder")) as xml_client:
        got = chat(xml_client, tools=tools, structured_outputs=forced, max_tokens=120)
        assert got["finish_reason"] == "tool_calls" and got["message"]["content"] == "Ok."
        (call,) = got["message"]["tool_calls"]
        assert call["function"]["name"] == "forecast" and json.loads(call["function"]["arguments"]) == {
            "city": "Paris",
            "days": 3,
        }
        calls, finish, content = stream(xml_client, tools=tools, structured_outputs=forced, max_tokens=120)
        assert content == "Ok. " and finish == "tool_calls"
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("forecast", {"city": "Paris", "days": 3})]


def test_refusals_are_vllms(engine, client):
    from prefixkv.server.app import create_app

    with TestClient(create_app(engine, engine_thread=False)) as no_flags:
        r = no_flags.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS})
        assert r.status_code == 400
        assert "requires --enable-auto-tool-choice and --tool-call-parser" in r.json()["error"]["message"]
    cases = [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "Tool 'nope' has not been passed"),
        ({"tools": None, "tool_choice": "required"}, "`tools` must be set"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ]
    for fields, needle in cases:
        r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, **fields})
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    r = client.post("/v1/completions", json={"prompt": "x", "tools": TOOLS})
    assert r.status_code == 400 and "/v1/chat/completions" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "parser, text, content, calls",
    [
        (HermesToolParser(), "Sure. " + HERMES_CALL, "Sure.", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
        (
            HermesToolParser(),
            HERMES_CALL + HERMES_CALL.replace("Paris", "Rome"),
            None,
            [
                ("get_weather", {"city": "Paris", "unit": "celsius"}),
                ("get_weather", {"city": "Rome", "unit": "celsius"}),
            ],
        ),
        (HermesToolParser(), '<tool_call>{"name": "f", "arguments": {}}', None, [("f", {})]),  # unclosed at the end
        (HermesToolParser(), "<tool_call>{not json</tool_call>", "<tool_call>{not json</tool_call>", []),
        (HermesToolParser(), "no call here", "no call here", []),
        (
            Llama3JsonToolParser(),
            '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
            None,
            [("f", {"a": 1}), ("g", {})],
        ),
        (Llama3JsonToolParser(), "Paris is sunny.", "Paris is sunny.", []),
        (
            MistralToolParser(),
            '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]',
            None,
            [("f", {"a": 1}), ("g", {})],
        ),
        (MistralToolParser(), "[TOOL_CALLS] [oops", "[TOOL_CALLS] [oops", []),
    ],
)
def test_parsers(parser, text, content, calls):
    got_content, got = parser.extract(text)
    assert got_content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got] == calls


WEATHER_PROPS = {
    "city": {"type": "string"},
    "days": {"type": "integer"},
    "metric": {"type": "boolean"},
    "tags": {"type": "array"},
    "ratio": {"type": "number"},
    "unit": {"enum": ["C", "F", 1]},
    "maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
    "opts": {"type": "object"},
    "free": {},
}


def xml_call(params: list[tuple[str, str]], name: str = "get_weather", wrapped: bool = True) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    call = f"<function={name}>\n{body}</function>"
    return f"<tool_call>\n{call}\n</tool_call>" if wrapped else call


# (model text, content, [[name, arguments]]): what vLLM 0.32's own qwen3_coder parser answers for
# these texts with a tool of WEATHER_PROPS (run side by side), arguments as it serializes them
QWEN3_XML_CASES = [
    (
        "Sure.\n" + xml_call([("city", "Paris"), ("days", "3"), ("metric", "true"), ("tags", '["a", "b"]')]),
        "Sure.",
        [["get_weather", '{"city": "Paris", "days": 3, "metric": true, "tags": ["a", "b"]}']],
    ),
    (
        xml_call([("city", "New York")]) + "\n" + xml_call([("city", "Rome")]),
        None,
        [["get_weather", '{"city": "New York"}'], ["get_weather", '{"city": "Rome"}']],
    ),
    ("No call here.", "No call here.", []),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis", None, [["get_weather", "{}"]]),
    (xml_call([("city", "Paris")], wrapped=False), None, [["get_weather", '{"city": "Paris"}']]),
    (
        xml_call(
            [("ratio", "1.5"), ("days", "x7"), ("metric", "0"), ("unit", "F"), ("maybe", "null")]
            + [("opts", '{"a": 1}'), ("free", "42")]
        ),
        None,
        [
            [
                "get_weather",
                '{"ratio": 1.5, "days": "x7", "metric": false, "unit": "F", "maybe": null, '
                '"opts": {"a": 1}, "free": "42"}',
            ]
        ],
    ),
    (
        xml_call([("ratio", "2.0"), ("days", "007"), ("unit", "1"), ("maybe", "5"), ("free", "hello"), ("extra", "9")]),
        None,
        [["get_weather", '{"ratio": 2, "days": 7, "unit": 1, "maybe": 5, "free": "hello", "extra": "9"}']],
    ),
    (xml_call([("city", "Paris")], name="unknown_tool"), None, [["unknown_tool", '{"city": "Paris"}']]),
    (
        xml_call([("ratio", "inf"), ("tags", "[1e999]"), ("city", "multi\nline")]),
        None,
        [["get_weather", '{"ratio": "inf", "tags": "[1e999]", "city": "multi\\nline"}']],
    ),
    (
        "<tool_call>\n<function=get_weather>\n<parameter=city>Paris<parameter=days>4</function></tool_call>",
        None,
        [["get_weather", '{"city": "Paris"}']],
    ),
]


@pytest.mark.parametrize("text,content,calls", QWEN3_XML_CASES)
def test_qwen3_xml_calls_read_as_vllm_reads_them(text, content, calls):
    """Parameters become their schema's types (vLLM's order of tries), a parameter not closed is
    dropped, `<function=` alone is a call, and an unknown tool's values stay text."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"properties": WEATHER_PROPS}}}]
    got_content, got = TOOL_PARSERS["qwen3_coder"](tools).extract(text)
    assert got_content == content
    assert [[c.function.name, c.function.arguments] for c in got] == calls


GLM_ARGS = "<arg_key>city</arg_key><arg_value>New York</arg_value>"
# (model text, content, [[name, arguments]]): vLLM 0.32's own glm45 parser's answers (run side by
# side, tool get_weather of WEATHER_PROPS), but for an undeclared tool's call: vLLM answers no
# content and no call, the text is dropped; here the text stays content
GLM_CASES = [
    (
        "Sure.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
        "Sure.",
        [["get_weather", '{"city": "Paris", "days": 3}']],
    ),
    (
        f"<tool_call>get_weather{GLM_ARGS}</tool_call><tool_call>get_weather<arg_key>metric</arg_key>"
        '<arg_value>true</arg_value><arg_key>tags</arg_key><arg_value>["x"]</arg_value></tool_call>',
        None,
        [["get_weather", '{"city": "New York"}'], ["get_weather", '{"metric": true, "tags": ["x"]}']],
    ),
    ("No call.", "No call.", []),
    ("<tool_call>get_weather</tool_call>", None, [["get_weather", "{}"]]),
    (
        "<tool_call>unknown<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
        "<tool_call>unknown<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",  # vLLM: None
        [],
    ),
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris", None, [["get_weather", "{}"]]),
    (
        "<tool_call>get_weather\n<arg_key> city </arg_key>\n<arg_value>\nParis\n</arg_value>\n</tool_call>",
        None,
        [["get_weather", '{"city": "\\nParis\\n"}']],
    ),
    (
        "text <tool_call>get_weather<arg_key>days</arg_key><arg_value>x</arg_value></tool_call> after",
        "text",
        [["get_weather", '{"days": "x"}']],
    ),
]


GLM_CASES.append(
    (
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>4",
        None,
        [["get_weather", '{"city": "Paris"}']],  # a call not closed keeps its closed arguments
    )
)
# the same for MiniMax-M2's parser (vLLM's answers, the undeclared tool's text kept here too)
MINIMAX_CASES = [
    (
        (
            'Sure.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name='
            '"city">Paris</parameter>\n<parameter name="days">3</parameter>\n</invoke'
            ">\n</minimax:tool_call>"
        ),
        "Sure.",
        [["get_weather", '{"city": "Paris", "days": 3}']],
    ),
    (
        (
            "<minimax:tool_call><invoke name='get_weather'><parameter name='metric'"
            ">true</parameter></invoke><invoke name=get_weather><parameter name=tag"
            's>["x"]</parameter></invoke></minimax:tool_call>'
        ),
        None,
        [["get_weather", '{"metric": true}'], ["get_weather", '{"tags": ["x"]}']],
    ),
    (
        "No call.",
        "No call.",
        [],
    ),
    (
        (
            '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city"'
            '>Paris</parameter>\n<parameter name="days">4'
        ),
        None,
        [["get_weather", '{"city": "Paris"}']],
    ),
    (
        ('<invoke name="get_weather"><parameter name="city"> Paris </parameter></invoke>'),
        None,
        [["get_weather", '{"city": " Paris "}']],
    ),
    (
        ('<minimax:tool_call><invoke name="unknown"><parameter name="a">1</parameter></invoke></minimax:tool_call>'),
        (
            '<minimax:tool_call><invoke name="unknown"><parameter name="a">1</parameter></invoke></minimax:tool_call>'
        ),  # vLLM: None
        [],
    ),
    (
        (
            'text <minimax:tool_call><invoke name="get_weather"><parameter name="da'
            'ys">x</parameter></invoke></minimax:tool_call> after'
        ),
        "text",
        [["get_weather", '{"days": "x"}']],
    ),
    (
        ('<minimax:tool_call><invoke name="get_weather"></invoke></minimax:tool_call>'),
        None,
        [["get_weather", "{}"]],
    ),
    (
        (
            '<minimax:tool_call><invoke name="get_weather"><parameter name="city">A'
            '<parameter name="days">5</parameter></invoke></minimax:tool_call>'
        ),
        None,
        [["get_weather", '{"city": "A", "days": 5}']],
    ),
]


# and for the pythonic parser (Llama 3.2 / 4): vLLM 0.32's answers, all of them
PYTHONIC_CASES = [
    ('[get_weather(city="Paris", days=3)]', None, [["get_weather", '{"city": "Paris", "days": 3}']]),
    (
        "[get_weather(city=\"Paris\"), get_time(tz='UTC')]",
        None,
        [["get_weather", '{"city": "Paris"}'], ["get_time", '{"tz": "UTC"}']],
    ),
    ("No call.", "No call.", []),
    (' [get_weather(city="Paris")]', ' [get_weather(city="Paris")]', []),
    ("[get_weather(1)]", "[get_weather(1)]", []),
    ("[get_weather()]", None, [["get_weather", "{}"]]),
    ("[]", "[]", []),
    (
        '[get_weather(a=None, b=true, c=null, d=(1, 2), e={"k": [1, -2.5]}, f=-3, g=f"x")]',
        None,
        [["get_weather", '{"a": null, "b": true, "c": null, "d": [1, 2], "e": {"k": [1, -2.5]}, "f": -3, "g": "x"}']],
    ),
    ("[get_weather(a=x)]", "[get_weather(a=x)]", []),
    ('[get_weather(city="Paris")] and more', '[get_weather(city="Paris")] and more', []),
    ("[a.b(c=1)]", "[a.b(c=1)]", []),
    ("[_f(x=1)]", "[_f(x=1)]", []),
    ('[get_weather(city="Paris")]\n[other(x=1)]', None, [["get_weather", '{"city": "Paris"}']]),
    ("[get_weather(_x=1)]", "[get_weather(_x=1)]", []),
    ("[get_weather(**kw)]", "[get_weather(**kw)]", []),
    ('[get_weather(a={"x"})]', None, [["get_weather", '{"a": ["x"]}']]),
    ('[f(a=b"x")]', '[f(a=b"x")]', []),
]


@pytest.mark.parametrize("text,content,calls", PYTHONIC_CASES)
def test_pythonic_calls_read_as_vllm_reads_them(text, content, calls):
    got_content, got = TOOL_PARSERS["pythonic"]().extract(text)
    assert got_content == content
    assert [[c.function.name, c.function.arguments] for c in got] == calls


LLAMA4_CASES = [  # llama4_pythonic: vLLM 0.32's answers
    ('<|python_start|>[get_weather(city="Paris")]<|python_end|>', None, [["get_weather", '{"city": "Paris"}']]),
    ('[get_weather(city="Paris")]', None, [["get_weather", '{"city": "Paris"}']]),
    ("<|python_start|>not a call<|python_end|>", "not a call", []),
    ("Hi <|python_start|>[f(a=1)]<|python_end|>", "Hi <|python_start|>[f(a=1)]<|python_end|>", []),
    ("<|python_start|>[f(a=1)]", None, [["f", '{"a": 1}']]),
]


@pytest.mark.parametrize("text,content,calls", LLAMA4_CASES)
def test_llama4_pythonic_calls_read_as_vllm_reads_them(text, content, calls):
    got_content, got = TOOL_PARSERS["llama4_pythonic"]().extract(text)
    assert got_content == content
    assert [[c.function.name, c.function.arguments] for c in got] == calls


def test_a_pythonic_stream_withholds_only_an_output_that_may_be_calls():
    s = ToolStream(ToolPlan("auto", [], parser=TOOL_PARSERS["pythonic"]()))
    assert s.delta(0, "[get_w", None)[0] is None
    assert s.delta(1, "It is [1]", None)[0] == "It is [1]"
    content, calls, finish = s.delta(0, '[get_weather(city="Paris")]', "stop")
    assert content is None and finish == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]
    content, calls, finish = s.delta(2, "[not a call", "stop")  # withheld, then sent whole
    assert content == "[not a call" and calls is None and finish == "stop"
    llama4 = ToolStream(ToolPlan("auto", [], parser=TOOL_PARSERS["llama4_pythonic"]()))
    assert llama4.delta(0, "<|python_st", None)[0] is None
    assert llama4.delta(0, "<|python_start|>not a call", None)[0] is None
    assert llama4.delta(0, "<|python_start|>not a call<|python_end|>", "stop")[0] == "not a call"  # as unstreamed


@pytest.mark.parametrize("text,content,calls", MINIMAX_CASES)
def test_minimax_calls_read_as_vllm_reads_them(text, content, calls):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"properties": WEATHER_PROPS}}}]
    got_content, got = TOOL_PARSERS["minimax_m2"](tools).extract(text)
    assert got_content == content
    assert [[c.function.name, c.function.arguments] for c in got] == calls


@pytest.mark.parametrize("text,content,calls", GLM_CASES)
def test_glm_calls_read_as_vllm_reads_them(text, content, calls):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"properties": WEATHER_PROPS}}}]
    for name in ("glm45", "glm47"):
        got_content, got = TOOL_PARSERS[name](tools).extract(text)
        assert got_content == content
        assert [[c.function.name, c.function.arguments] for c in got] == calls


# vLLM 0.32's `gemma4` parser on gemma4.CALLS with gemma4.TOOLS (`extract_tool_calls`): content, calls
GEMMA4_VLLM = [
    (None, [["get_weather", '{"location": "Tokyo", "days": 3}']]),
    ("Let me check.", [["get_weather", '{"location": "San Francisco, CA"}'], ["get_time", '{"zone": "UTC"}']]),
    (
        None,
        [
            [
                "search",
                '{"query": "a {b} [c]", "filters": {"lang": "en", "max": 5}, "tags": ["x", "y"], "exact": true}',
            ]
        ],
    ),
    ("No call here.", []),
    (None, [["get_weather", '{"location": "Paris"}']]),
    (None, [["get_time", "{}"]]),
    (None, [["get_weather", '{"days": 7, "ratio": "0.5", "flag": false}']]),
    (None, [["unknown_tool", '{"a": "1", "b": ["1", "2"]}']]),
    ("and more", [["get_weather", '{"location": "Oslo"}']]),
]


@pytest.mark.parametrize("at", range(len(gemma4.CALLS)))
def test_gemma4_calls_read_as_vllm_reads_them(at):
    text, (content, calls) = gemma4.CALLS[at], GEMMA4_VLLM[at]
    got_content, got = TOOL_PARSERS["gemma4"](gemma4.TOOLS).extract(text)
    assert (got_content if got else text) == (content if calls else text)
    assert [[c.function.name, c.function.arguments] for c in got] == calls


def test_gemma4_calls_without_a_name_or_a_schema():
    parser = TOOL_PARSERS["gemma4"]()
    assert parser.extract("Hi <|tool_call>call:{a:1}<tool_call|>") == ("Hi <|tool_call>call:{a:1}<tool_call|>", [])
    _, (call,) = parser.extract('<|tool_call>call:f{s:<|"|>a:b,c<|"|>,n:-1.5e3,o:{}}<tool_call|>')
    assert json.loads(call.function.arguments) == {"s": "a:b,c", "n": "-1.5e3", "o": {}}
    assert parser.keeps_special_tokens  # its markers are special tokens: the text must keep them


def test_gemma4_calls_of_any_text_never_raise():
    """Whatever a model writes after the marker: a call or the text back, never an exception
    (nesting past Python's stack included)."""
    import random

    parser = TOOL_PARSERS["gemma4"](gemma4.TOOLS)
    deep = "<|tool_call>call:f{a:" + "[" * 5000 + "]" * 5000 + "}<tool_call|>"
    assert parser.extract(deep) == (deep, [])
    pieces = ["{", "}", "[", "]", ":", ",", '<|"|>', "a", "1", " ", "call:", "get_weather", "<tool_call|>"]
    rng = random.Random(0)
    for _ in range(3000):
        text = "<|tool_call>" + "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 30)))
        content, calls = parser.extract(text)
        assert calls or content == text
        for c in calls:
            json.loads(c.function.arguments)


def test_a_stream_withholds_what_may_begin_a_call():
    s = ToolStream(ToolPlan("auto", [], parser=HermesToolParser()))
    assert s.delta(0, "Hi <tool", None)[0] == "Hi "  # "<tool" may begin "<tool_call>": it waits
    assert s.delta(0, "Hi <toolbox", None)[0] == "<toolbox"
    assert s.delta(0, "Hi <toolbox " + HERMES_CALL[:20], None)[0] == " "
    content, calls, finish = s.delta(0, "Hi <toolbox " + HERMES_CALL, "stop")
    assert content is None and finish == "tool_calls" and calls[0].function.name == "get_weather"
    # a parser with two ways to begin a call waits at either
    xml = ToolStream(ToolPlan("auto", [], parser=TOOL_PARSERS["qwen3_xml"]()))
    assert xml.delta(0, "Hi <func", None)[0] == "Hi "
    assert xml.delta(0, "Hi <function=f>", None)[0] is None
    content, calls, finish = xml.delta(0, "Hi <function=f>\n</function>", "stop")
    assert content is None and finish == "tool_calls" and [c.function.name for c in calls] == ["f"]


TOOLS_TEMPLATE = (  # the shape of Qwen2.5's: the tools as JSON in the system turn
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools><|im_end|>\n{% endif %}{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{{ message.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tools_go_into_the_chat_template(default_lm):
    import copy
    import dataclasses

    from prefixkv.config import EngineConfig
    from prefixkv.engine.llm_engine import LLMEngine
    from prefixkv.server.app import create_app

    tokenizer = copy.copy(default_lm.tokenizer)  # the same tokenizer with a template that renders tools
    tokenizer.chat_template, tokenizer._template = TOOLS_TEMPLATE, None
    engine = LLMEngine(
        EngineConfig(dtype="float32", device="cpu", num_blocks=32, max_model_len=512),
        loaded=dataclasses.replace(default_lm, tokenizer=tokenizer),
    )
    with TestClient(create_app(engine, tool_call_parser="hermes")) as c:
        body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 1, "prompt_logprobs": 0}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        entries = r.json()["prompt_logprobs"][1:]
        prompt = "".join(next(iter(e.values()))["decoded_token"] for e in entries)
        assert json.dumps(TOOLS[0]["function"]["parameters"]) in prompt and "<tools>" in prompt, prompt
