"""The texts, prompts and tools on which Gemma 4's parsers are checked against vLLM 0.32's own
`gemma4` parser (tests/test_reasoning.py, tests/server/test_tools.py); vLLM's answers were taken
with `bench/peers` vLLM on the scripted Gemma 4 tokenizer (tests/scripted_gemma4.py)."""

from __future__ import annotations

Q = '<|"|>'

TEXTS = [
    "<|channel>thought\nhm, Paris.<channel|>Paris!",
    "Paris!",  # no channel: all answer
    "<|channel>thought\nstill thinking",  # cut short
    "<|channel>thought\nhm<|tool_call>call:f{n:42}<tool_call|>",  # a call ends the reasoning
    "<|channel>thought\na<channel|>b<|channel>thought\nc<channel|>d",  # a second channel
    "thought\nhm<channel|>Paris",  # the label without its opener
    "a<channel|>b",  # a stray end
    "<|channel>hm<channel|>x",  # no label
    "thoughtful answer",
    "<|channel>thought\n<channel|>Paris",  # empty reasoning
    "<|channel>thought",  # only the label's word
]
PROMPTS = [
    "<|turn>user\nHi<turn|>\n<|turn>model\n",
    "<|turn>model\n<|channel>thought\n",  # a continued turn, inside the channel
    "<|turn>model\n<|channel>thought\nx<channel|>",
    "<|turn>model\n<|channel>thought\nx<|tool_call>call:f{}<tool_call|><|tool_response>response:f{}<tool_response|>",
    "<|turn>model\n<|channel>thought\nx<|tool_response>",
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {"type": "string"},
                    "days": {"type": "integer"},
                    "flag": {"type": "boolean"},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}},
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "filters": {
                        "type": "object",
                        "properties": {"lang": {"type": "string"}, "max": {"type": "integer"}},
                    },
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "exact": {"type": "boolean"},
                },
            },
        },
    },
]
CALLS = [
    f"<|tool_call>call:get_weather{{location:{Q}Tokyo{Q},days:3}}<tool_call|>",
    f"Let me check.<|tool_call>call:get_weather{{location:{Q}San Francisco, CA{Q}}}<tool_call|>"
    f"<|tool_call>call:get_time{{zone:{Q}UTC{Q}}}<tool_call|>",
    f"<|tool_call>call:search{{query:{Q}a {{b}} [c]{Q},filters:{{lang:{Q}en{Q},max:5}},"
    f"tags:[{Q}x{Q},{Q}y{Q}],exact:true}}<tool_call|>",
    "No call here.",
    f"<|tool_call>call:get_weather{{location:{Q}Paris{Q}",  # not closed
    "<|tool_call>:get_time{}<tool_call|>",  # the opener without "call"
    f"<|tool_call>call:get_weather{{days:{Q}7{Q},ratio:0.5,flag:false}}<tool_call|>",  # typed by the schema
    "<|tool_call>call:unknown_tool{a:1,b:[1,2]}<tool_call|>",  # no schema: bare values stay text
    f"<|tool_call>call:get_weather{{location:{Q}Oslo{Q}}}<tool_call|> and more",
]
