"""OpenAI's harmony format (prefixkv/harmony.py) and the `openai_gptoss` reasoning parser: each
reply's messages as openai_harmony's StreamableParser reads them (the table below is its output,
run in the vLLM peer's venv on the same replies tokenized by its o200k_harmony encoding); the
split into reasoning, content and tool calls by vLLM's harmony rules; a stream's pieces only
growing; the reasoning tokens counted; what the parser refuses."""

from __future__ import annotations

import pytest

from prefixkv import harmony
from prefixkv.harmony import HarmonyReply, split_tool_calls

# (reply text, [(channel, recipient, content type, text) per message], openai_harmony's EOS error)
# ruff: noqa: E501 (the replies are the table's data, one line each)
ORACLE = [
    (
        "<|channel|>analysis<|message|>User greets. Respond.<|end|><|start|>assistant<|channel|>final<|message|>Hello! How can I help?",
        [("analysis", None, None, "User greets. Respond."), ("final", None, None, "Hello! How can I help?")],
        False,
    ),
    (
        '<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}',
        [
            ("analysis", None, None, "Need weather."),
            ("commentary", "functions.get_weather", "<|constrain|>json", '{"city": "Paris"}'),
        ],
        False,
    ),
    (
        '<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Paris"}',
        [
            ("analysis", None, None, "Need weather."),
            ("commentary", "functions.get_weather", "json", '{"city":"Paris"}'),
        ],
        False,
    ),
    (
        '<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant<|channel|>commentary to=functions.lookup<|message|>{"q": 1}',
        [("commentary", None, None, "Let me check."), ("commentary", "functions.lookup", None, '{"q": 1}')],
        False,
    ),
    ("<|channel|>final<|message|>Just an answer", [("final", None, None, "Just an answer")], False),
    (
        "<|channel|>analysis<|message|>Thinking about it and not done",
        [("analysis", None, None, "Thinking about it and not done")],
        False,
    ),
    (
        "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|><|start|>assistant<|channel|>final<|message|>c<|end|><|start|>assistant<|channel|>final<|message|>d",
        [
            ("analysis", None, None, "a"),
            ("analysis", None, None, "b"),
            ("final", None, None, "c"),
            ("final", None, None, "d"),
        ],
        False,
    ),
    (
        '<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>commentary to=browser.search <|constrain|>json<|message|>{"query": "a"}',
        [("analysis", None, None, "x"), ("commentary", "browser.search", "<|constrain|>json", '{"query": "a"}')],
        False,
    ),
    ("plain text without any header", [], True),
    (
        "<|channel|>analysis<|message|>multi\nline <b>html</b> &amp; unicode é 中文<|end|><|start|>assistant<|channel|>final<|message|>done é",
        [("analysis", None, None, "multi\nline <b>html</b> &amp; unicode é 中文"), ("final", None, None, "done é")],
        False,
    ),
    (
        '<|channel|>commentary to=functions.x<|constrain|>json<|message|>{"a":[1,2]}<|call|>',
        [("commentary", "functions.x", "<|constrain|>json", '{"a":[1,2]}')],
        False,
    ),
    (
        "<|channel|>analysis<|message|>send to=functions.y later<|end|><|start|>assistant<|channel|>final<|message|>ok to=z<|return|>",
        [("analysis", None, None, "send to=functions.y later"), ("final", None, None, "ok to=z")],
        False,
    ),
    (
        "<|channel|>final<|message|><|end|><|start|>assistant<|channel|>final<|message|>second",
        [("final", None, None, ""), ("final", None, None, "second")],
        False,
    ),
    (
        "<|channel|>commentary to=functions.run <|constrain|>python<|message|>print(1)",
        [("commentary", "functions.run", "<|constrain|>python", "print(1)")],
        False,
    ),
]


@pytest.mark.parametrize("text,messages,error", ORACLE)
def test_messages_equal_openai_harmony(text, messages, error):
    reply = HarmonyReply()
    got = [(m.channel, m.recipient, m.content_type, m.text) for m in reply.update(text)]
    assert got == messages
    assert bool(reply.unparsed) == error  # an unended header: harmony's error at EOS


def pieces(text: str) -> list[str]:
    """The reply as a stream sees it: a marker whole (one special token), other text a character
    at a time."""
    out, at = [], 0
    while at < len(text):
        marker = next((m for m in harmony.MARKERS if text.startswith(m, at)), None)
        out.append(marker or text[at])
        at += len(out[-1])
    return out


@pytest.mark.parametrize("text,messages,error", ORACLE)
def test_messages_grow_piece_by_piece(text, messages, error):
    """Fed its prefixes one after another (as a stream's updates), a reply ends with the same
    messages, and each message's text only grows."""
    reply, sofar = HarmonyReply(), ""
    seen: dict[int, str] = {}
    for piece in pieces(text):
        sofar += piece
        for i, m in enumerate(reply.update(sofar)):
            assert m.text.startswith(seen.get(i, ""))
            seen[i] = m.text
    assert [(m.channel, m.recipient, m.content_type, m.text) for m in reply.messages] == messages


def test_kinds_and_arguments():
    """vLLM's sorting: analysis is reasoning, final and a preamble (commentary without recipient)
    content, a recipient that is a function (functions.NAME, or a bare name) a tool call, a
    builtin tool's message ignored; JSON arguments re-serialised, other content types kept."""
    kinds = {
        ("analysis", None): "reasoning",
        ("final", None): "content",
        ("commentary", None): "content",
        ("commentary", "functions.get_weather"): "tool",
        ("commentary", "lookup"): "tool",
        ("commentary", "browser.search"): "ignored",
        ("commentary", "python"): "ignored",
        ("commentary", "functions."): "ignored",
        ("other", None): "ignored",
    }
    for (channel, recipient), kind in kinds.items():
        assert harmony.HarmonyMessage("assistant", channel, recipient, None, "", True).kind == kind
    call = harmony.HarmonyMessage("assistant", "commentary", "functions.f", "<|constrain|>json", '{"a":1}', True)
    assert call.function == "f" and call.arguments() == '{"a": 1}'
    assert harmony.HarmonyMessage("assistant", "commentary", "f", "python", "x=1", True).arguments() == "x=1"
    assert harmony.HarmonyMessage("assistant", "commentary", "f", None, "not json", True).arguments() == "not json"


def test_tool_call_text_reads_back():
    for text, _, _ in ORACLE:
        for m in HarmonyReply().update(text):
            if m.kind != "tool":
                continue
            m.done = True  # ended: what follows its call is not its text
            rest, calls = split_tool_calls("before" + harmony.tool_call_text(m) + "after")
            assert rest == "beforeafter"
            assert [(c.channel, c.recipient, c.content_type, c.text) for c in calls] == [
                (m.channel, m.recipient, m.content_type, m.text)
            ]
            m.done = False  # still being written: its text runs to the end
            rest, calls = split_tool_calls("before" + harmony.tool_call_text(m))
            assert rest == "before" and [c.text for c in calls] == [m.text]


@pytest.fixture(scope="module")
def parser(tmp_path_factory):
    """The `openai_gptoss` parser on a vocabulary of bytes and harmony's markers (special tokens,
    one each, as gpt-oss's)."""
    from prefixkv.model.tokenizer import Tokenizer
    from prefixkv.reasoning import REASONING_PARSERS

    from .scripted_thinker import write_scripted_model

    folder = tmp_path_factory.mktemp("harmony") / "model"
    write_scripted_model(folder, [], list(harmony.MARKERS), [("a", "b")], "", [harmony.RETURN, harmony.CALL])
    tokenizer = Tokenizer.from_hf_folder(str(folder))
    return REASONING_PARSERS["openai_gptoss"](tokenizer), tokenizer


SPLITS = [  # reply -> (reasoning, content, [(function, arguments)]) by vLLM's harmony rules
    (ORACLE[0][0], "User greets. Respond.", "Hello! How can I help?", []),
    (ORACLE[1][0], "Need weather.", None, [("get_weather", '{"city": "Paris"}')]),
    (ORACLE[3][0], "", "Let me check.", [("lookup", '{"q": 1}')]),
    (ORACLE[6][0], "a\nb", "c\nd", []),
    (ORACLE[7][0], "x", None, []),  # a builtin tool's call: left out
    (ORACLE[8][0], "", "plain text without any header", []),  # not harmony: the text is the answer
    (ORACLE[12][0], "", "second", []),
    (ORACLE[13][0], "", None, [("run", "print(1)")]),
]


@pytest.mark.parametrize("text,reasoning,content,calls", SPLITS)
def test_split_and_tool_calls(parser, text, reasoning, content, calls):
    from prefixkv.server.tools import OpenAIToolParser

    p, _ = parser
    thought, answer = p.split(p.thinks([])).update(text, [], finished=True)
    rest, got = OpenAIToolParser().extract(answer)
    assert (thought, rest, [(c.function.name, c.function.arguments) for c in got]) == (reasoning, content, calls)


@pytest.mark.parametrize("text,reasoning,content,calls", SPLITS)
def test_a_streamed_split_only_grows(parser, text, reasoning, content, calls):
    p, _ = parser
    split = p.split(True)
    sofar, last = "", ("", "")
    units = pieces(text)
    for k, piece in enumerate(units):
        sofar += piece
        now = split.update(sofar, [], finished=k == len(units) - 1)
        assert now[0].startswith(last[0]) and now[1].startswith(last[1])
        last = now
    assert last == p.split(True).update(text, [], finished=True)


def test_reasoning_tokens_are_the_analysis_and_call_bodies(parser):
    """Counted as vLLM counts them: the tokens of analysis bodies and of bodies sent to a recipient,
    markers and headers not counted."""
    p, tokenizer = parser
    for text, messages, _ in ORACLE:
        ids = tokenizer.encode(text, add_special_tokens=False)
        bodies = [m[3] for m in messages if m[0] == "analysis" or (m[0] == "commentary" and m[1] is not None)]
        assert p.reasoning_tokens(ids, True) == sum(len(tokenizer.encode(b, add_special_tokens=False)) for b in bodies)


def test_the_grammar_waits_for_the_final_channel_and_the_budget_is_refused(parser):
    """A grammar opens after `<|channel|>final<|message|>` (as the tokenizer spells it);
    thinking_token_budget, whose end would be a whole header, is refused by name."""
    p, tokenizer = parser
    gate = p.grammar_gate()
    assert gate.after_run == tuple(tokenizer.encode("<|channel|>final<|message|>", add_special_tokens=False))
    assert not gate.after and not gate.at
    with pytest.raises(ValueError, match="thinking_token_budget"):
        p.thinking_budget(8)
