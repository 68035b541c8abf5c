"""Gemma 4's reasoning parser (prefixkv/reasoning.py's Gemma4ReasoningParser) on a tokenizer with
its markers as special tokens (tests/scripted_gemma4.py): where a reply starts in reasoning, the
split of a reply fed whole and fed a token at a time, against vLLM 0.32's own `gemma4` parser run
on the same texts (tests/server/gemma4_parser_cases.py), the reasoning tokens counted."""

from __future__ import annotations

import pytest

from prefixkv.model.tokenizer import Tokenizer
from prefixkv.reasoning import REASONING_PARSERS, Gemma4ReasoningParser

from .scripted_gemma4 import write_scripted_gemma4
from .server.gemma4_parser_cases import PROMPTS, TEXTS

# vLLM's answers: `Gemma4Parser.extract_reasoning(text)` (its None as ""), and for each prompt
# whether its reply starts in the answer (not `_prompt_ends_in_open_reasoning`)
VLLM_SPLITS = [
    ("hm, Paris.", "Paris!"),
    ("", "Paris!"),
    ("still thinking", ""),
    ("hm", ""),
    ("athought\nc", "bd"),
    ("hm", "Paris"),
    ("a", "b"),
    ("hm", "x"),
    ("", "thoughtful answer"),
    ("", "Paris"),
    ("", ""),
]
VLLM_ENDED = [True, False, True, True, True]
# Where this parser answers otherwise, and why:
DIFFERENT = {
    # the call stays in the content, where the `gemma4` tool parser reads it (vLLM's one parser
    # reads both and leaves "" of the content once the call is taken out)
    3: ("hm", "<|tool_call>call:f{n:42}<tool_call|>"),
    # an end with no start, after the reply's first token: dropped, as vLLM's stream does; its
    # unstreamed read takes what came before for reasoning, which a stream cannot know in time
    6: ("", "ab"),
}


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_hf_folder(str(write_scripted_gemma4(tmp_path_factory.mktemp("gemma4"))))


@pytest.fixture(scope="module")
def parser(tok) -> Gemma4ReasoningParser:
    return Gemma4ReasoningParser(tok)


def ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text)


def split_streamed(tok: Tokenizer, parser, thinking: bool, token_ids: list[int]) -> tuple[str, str]:
    """Fed a token at a time, then finished: neither part ever shrinks."""
    s = parser.split(thinking)
    reasoning = content = ""
    for n in range(1, len(token_ids) + 1):
        last = n == len(token_ids)
        r, c = s.update(tok.decode(token_ids[:n], skip_special_tokens=False), token_ids[:n], finished=last)
        assert r.startswith(reasoning) and c.startswith(content), (r, c)
        reasoning, content = r, c
    return reasoning, content


def test_the_parser_is_registered_under_vllms_name(parser):
    assert REASONING_PARSERS["gemma4"] is Gemma4ReasoningParser and parser.special


def test_where_a_reply_starts_in_reasoning_agrees_with_vllm(tok, parser):
    assert [not parser.thinks(ids(tok, p)) for p in PROMPTS] == VLLM_ENDED
    # template options are not read: the model opens its channel itself
    assert not parser.thinks(ids(tok, PROMPTS[0]), {"enable_thinking": True})


@pytest.mark.parametrize("at", range(len(TEXTS)))
def test_splits_agree_with_vllm_whole_and_streamed(tok, parser, at):
    text = TEXTS[at]
    token_ids = ids(tok, text)
    assert tok.decode(token_ids, skip_special_tokens=False) == text
    want = DIFFERENT.get(at, VLLM_SPLITS[at])
    assert parser.split(False).update(text, token_ids, finished=True) == want
    assert split_streamed(tok, parser, False, token_ids) == want


def test_a_reply_inside_an_open_channel_starts_in_reasoning(tok, parser):
    for text, want in [
        ("hm<channel|>Paris", ("hm", "Paris")),
        ("hm<|tool_call>call:f{}<tool_call|>", ("hm", "<|tool_call>call:f{}<tool_call|>")),
        ("<|channel>thought\nhm<channel|>x", ("hm", "x")),  # its own opener swallowed
        ("still", ("still", "")),
    ]:
        token_ids = ids(tok, text)
        assert parser.split(True).update(text, token_ids, finished=True) == want
        assert split_streamed(tok, parser, True, token_ids) == want


def test_a_marker_counts_only_where_its_token_was_generated(tok, parser):
    spelled = [t for ch in "<|channel>" for t in ids(tok, ch)]
    token_ids = ids(tok, "a") + spelled + ids(tok, "b<channel|>c")
    text = tok.decode(token_ids, skip_special_tokens=False)
    assert text == "a<|channel>b<channel|>c" and parser.start_id not in token_ids
    assert parser.split(False).update(text, token_ids, finished=True) == ("", "a<|channel>bc")
    # an end's text arriving a step after its token is taken then
    s = parser.split(False)
    token_ids = ids(tok, "<|channel>thought\nhm<channel|>OK")
    assert s.update("<|channel>thought\nhm", token_ids) == ("hm", "")
    assert s.update("<|channel>thought\nhm<channel|>OK", token_ids) == ("hm", "OK")


def test_reasoning_tokens(tok, parser):
    count = parser.reasoning_tokens
    assert count(ids(tok, "<|channel>thought\nhm<channel|>OK"), False) == 3  # the label's token and h, m
    assert count(ids(tok, "Paris"), False) == 0 and count(ids(tok, "hm<channel|>OK"), True) == 2
    assert count(ids(tok, "<|channel>a<channel|>b<|channel>cd<|tool_call>e"), False) == 3
    assert count(ids(tok, "thought\nhm<channel|>x"), False) == 3  # a reply that begins with the label


def test_any_reply_splits_the_same_streamed_or_whole(tok, parser):
    """Random replies of markers and text, from either start: the stream's parts only grow and
    end where the whole reply's split does; nothing is lost but markers and the label."""
    import random

    pieces = ["<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "thought\n", "thought", "h", "m", "\n"]
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 12)))
        token_ids = ids(tok, text)
        for thinking in (False, True):
            whole = parser.split(thinking).update(text, token_ids, finished=True)
            assert split_streamed(tok, parser, thinking, token_ids) == whole, (text, thinking)
            kept = text.replace("<|channel>", "").replace("<channel|>", "").replace("thought", "").replace("\n", "")
            assert sorted(kept) == sorted("".join(whole).replace("thought", "").replace("\n", "")), (text, whole)
