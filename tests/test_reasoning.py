"""Reasoning parsers (prefixkv/reasoning.py) on a tokenizer with Qwen 3's markers: where an output
starts in reasoning (its prompt, its template options), where the reasoning ends (a generated end
token, or a Qwen 3 tool call), the split fed as a stream equal to the split of the whole, the
reasoning tokens counted, and the grammar gate they hand the engine."""

from __future__ import annotations

import re

import pytest

from prefixkv.model.tokenizer import Tokenizer
from prefixkv.reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Glm45ReasoningParser,
    MiniMaxM2ReasoningParser,
    Qwen3ReasoningParser,
)

from .scripted_thinker import write_scripted_thinker

# the parsers of `<think>` ... `</think>` (gpt-oss's harmony has its own tests: tests/test_harmony.py)
THINK_PARSERS = sorted(name for name, cls in REASONING_PARSERS.items() if cls.start == "<think>")


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_hf_folder(str(write_scripted_thinker(tmp_path_factory.mktemp("thinker"))))


def ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text)


def split_whole(parser, thinks: bool, text: str, token_ids: list[int]) -> tuple[str, str]:
    return parser.split(thinks).update(text, token_ids)


def split_streamed(tok, parser, thinks: bool, token_ids: list[int]) -> tuple[str, str]:
    """Fed a token at a time, as a stream grows: what is sent of each is what it grew by, and
    neither ever shrinks."""
    s = parser.split(thinks)
    reasoning = content = ""
    for n in range(1, len(token_ids) + 1):
        r, c = s.update(tok.decode(token_ids[:n]), token_ids[:n])
        assert r.startswith(reasoning) and c.startswith(content), (r, c)
        reasoning, content = r, c
    return reasoning, content


TEXTS = [
    "<think>\nhm, Paris.\n</think>\n\nParis!",
    "hm, Paris.</think>Paris!",  # <think> was in the prompt
    "<think>still thinking",  # cut short: all reasoning
    "<think>hm</think>",
    "<think>hm <tool_call>{}</tool_call>",  # a tool call without the end
    "<think>hm</think>a</think>b",  # a second end
    "Paris!",  # no marker: all reasoning while thinking
    "<think>hm <minimax:tool_call>x</minimax:tool_call>",  # MiniMax-M2's call
    "<think>a</think>b<think>c</think>d",  # thinking again in the answer (GLM's interleaving)
    "<think>a \n</think>b<think>c\n</think>d ",  # ... with whitespace
    "<think>a</think>b<think>c",  # ... cut short
]
PROMPTS = [  # Qwen 3's turns, then GLM's
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>assistant\n<think>\n",
    "<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "<|im_start|>assistant\n<think>a</think>b<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<|assistant|><think>a</think>b<|user|>Hi<|assistant|>",
    "<|user|>Hi<|assistant|><think></think>",
]
# What vLLM 0.32's own parsers answer on this tokenizer (run side by side): each text's
# (reasoning, content) when thinking (`extract_reasoning`, its None as ""), and for each prompt
# whether the reasoning already ended there (`is_reasoning_end`)
VLLM = {
    "deepseek_r1": {
        "splits": [
            ("\nhm, Paris.\n", "\n\nParis!"),
            ("hm, Paris.", "Paris!"),
            ("still thinking", ""),
            ("hm", ""),
            ("hm <tool_call>{}</tool_call>", ""),
            ("hm", "a</think>b"),
            ("Paris!", ""),
            ("hm <minimax:tool_call>x</minimax:tool_call>", ""),
            ("a", "b<think>c</think>d"),
            ("a \n", "b<think>c\n</think>d "),
            ("a", "b<think>c"),
        ],
        "ended": [False, False, True, True, True, True],
    },
    "qwen3": {
        "splits": [
            ("\nhm, Paris.\n", "\n\nParis!"),
            ("hm, Paris.", "Paris!"),
            ("still thinking", ""),
            ("hm", ""),
            ("hm ", "<tool_call>{}</tool_call>"),
            ("hm", "ab"),
            ("Paris!", ""),
            ("hm <minimax:tool_call>x</minimax:tool_call>", ""),
            ("a", "b<think>cd"),
            ("a \n", "b<think>c\nd "),
            ("a", "b<think>c"),
        ],
        "ended": [False, False, True, False, True, True],
    },
    "glm45": {
        "splits": [
            ("\nhm, Paris.", "\n\nParis!"),
            ("hm, Paris.", "Paris!"),
            ("still thinking", ""),
            ("hm", ""),
            ("hm", "<tool_call>{}</tool_call>"),
            ("hm", "ab"),
            ("Paris!", ""),
            ("hm <minimax:tool_call>x</minimax:tool_call>", ""),
            ("ac", "bd"),
            ("a \nc", "bd "),
            ("ac", "b"),
        ],
        "ended": [False, False, True, True, False, True],
    },
    "minimax_m2": {
        "splits": [
            ("\nhm, Paris.", "\n\nParis!"),
            ("hm, Paris.", "Paris!"),
            ("still thinking", ""),
            ("hm", ""),
            ("hm <tool_call>{}</tool_call>", ""),
            ("hm", "ab"),
            ("Paris!", ""),
            ("hm", "<minimax:tool_call>x</minimax:tool_call>"),
            ("a", "b<think>cd"),
            ("a", "b<think>c\nd "),
            ("a", "b<think>c"),
        ],
        "ended": [False, False, True, True, True, True],
    },
}
VLLM["glm47"] = VLLM["glm45"]
# deepseek_v3 thinks only when told: told (`thinking: true`), vLLM's answers are deepseek_r1's;
# untold, the reasoning has always ended (no reasoning)
VLLM["deepseek_v3"] = {"splits": VLLM["deepseek_r1"]["splits"], "ended": [True] * len(PROMPTS)}


@pytest.mark.parametrize("name", THINK_PARSERS)
def test_where_a_reply_starts_in_reasoning_agrees_with_vllm(tok, name):
    parser = REASONING_PARSERS[name](tok)
    assert [not parser.thinks(ids(tok, p)) for p in PROMPTS] == VLLM[name]["ended"]


@pytest.mark.parametrize("name", THINK_PARSERS)
@pytest.mark.parametrize("at", range(len(TEXTS)))
def test_splits_whole_and_streamed_alike(tok, name, at):
    parser = REASONING_PARSERS[name](tok)
    text = TEXTS[at]
    token_ids = ids(tok, text)
    want = VLLM[name]["splits"][at]
    assert split_whole(parser, True, text, token_ids) == want
    assert split_streamed(tok, parser, True, token_ids) == want
    assert split_whole(parser, False, text, token_ids) == ("", text)  # not thinking: all answer


def test_an_end_counts_only_where_its_token_was_generated(tok):
    """Text that spells "</think>" in byte tokens ends nothing: the engine's gate, which reads
    tokens, would not open there either."""
    parser = DeepSeekR1ReasoningParser(tok)
    spelled = [t for ch in "</think>" for t in ids(tok, ch)]
    token_ids = ids(tok, "hm") + spelled + ids(tok, "ok")
    text = tok.decode(token_ids)
    assert text == "hm</think>ok" and parser.end_id not in token_ids
    assert split_whole(parser, True, text, token_ids) == ("hm</think>ok", "")
    # and a Qwen 3 tool call is no end for DeepSeek-R1
    token_ids = ids(tok, "<think>hm <tool_call>x")
    assert split_whole(parser, True, tok.decode(token_ids), token_ids) == ("hm <tool_call>x", "")
    # nor does it drop a second end: DeepSeek-R1's answer keeps it, as vLLM's parser does
    token_ids = ids(tok, "<think>hm</think>a</think>b")
    assert split_whole(parser, True, tok.decode(token_ids), token_ids) == ("hm", "a</think>b")


def test_an_end_whose_text_comes_later_is_found_then(tok):
    """The end token seen before its text (characters held back until complete): found at the
    next update."""
    parser = Qwen3ReasoningParser(tok)
    s = parser.split(True)
    token_ids = ids(tok, "<think>hm</think>OK")
    assert s.update("<think>hm", token_ids) == ("hm", "")
    assert s.update("<think>hm</think>OK", token_ids) == ("hm", "OK")


def test_where_an_output_starts_in_reasoning_and_the_template_options(tok):
    qwen3, r1 = Qwen3ReasoningParser(tok), DeepSeekR1ReasoningParser(tok)
    turn = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    for parser in (qwen3, r1):
        assert parser.thinks(ids(tok, turn))  # thinking models think unless told otherwise
        assert parser.thinks(ids(tok, turn + "<think>\n"))
        assert not parser.thinks(ids(tok, turn + "<think>\n\n</think>\n\n"))  # a template that turns it off
    # an earlier turn's reasoning ended: Qwen 3 stops at the turn's start, DeepSeek-R1 reads on
    earlier = "<|im_start|>assistant\n<think>a</think>b<|im_end|>\n" + turn
    assert qwen3.thinks(ids(tok, earlier)) and not r1.thinks(ids(tok, earlier))
    assert not qwen3.thinks(ids(tok, turn), {"enable_thinking": False})
    assert qwen3.thinks(ids(tok, turn), {"enable_thinking": True}) and r1.thinks(
        ids(tok, turn), {"enable_thinking": False}
    )
    # GLM reads either option (any true one thinks); MiniMax-M2 reads none (as vLLM's parsers)
    glm, minimax = Glm45ReasoningParser(tok), MiniMaxM2ReasoningParser(tok)
    assert not glm.thinks(ids(tok, turn), {"thinking": False})
    assert not glm.thinks(ids(tok, turn), {"enable_thinking": False})
    assert glm.thinks(ids(tok, turn), {"thinking": False, "enable_thinking": True}) and glm.thinks(ids(tok, turn), {})
    assert minimax.thinks(ids(tok, turn), {"enable_thinking": False})
    # DeepSeek-V3.1 thinks only when told, then by DeepSeek-R1's rules (as vLLM's, run side by side)
    v3 = REASONING_PARSERS["deepseek_v3"](tok)
    assert not v3.thinks(ids(tok, turn)) and not v3.thinks(ids(tok, turn), {"thinking": False})
    for told in ({"thinking": True}, {"enable_thinking": True}, {"thinking": False, "enable_thinking": True}):
        assert [not v3.thinks(ids(tok, p), told) for p in PROMPTS] == VLLM["deepseek_r1"]["ended"]
    # each parser's scan stops at its own family's turns only (GLM's are not Qwen's)
    assert not glm.thinks(ids(tok, earlier)) and not minimax.thinks(ids(tok, earlier))


def test_reasoning_tokens_and_the_grammar_gate(tok):
    qwen3, r1 = Qwen3ReasoningParser(tok), DeepSeekR1ReasoningParser(tok)
    token_ids = ids(tok, "<think>hm</think>OK")
    assert qwen3.reasoning_tokens(token_ids, True) == 2 and qwen3.reasoning_tokens(token_ids, False) == 0
    assert qwen3.reasoning_tokens(ids(tok, "hm<tool_call>OK"), True) == 2
    assert r1.reasoning_tokens(ids(tok, "hm<tool_call>OK"), True) == 5  # no end: all of it
    interleaved = ids(tok, "<think>ab</think>c<think>de</think>f")
    assert Glm45ReasoningParser(tok).reasoning_tokens(interleaved, True) == 4  # both spans
    assert (
        qwen3.reasoning_tokens(interleaved, True) == 2
        and Glm45ReasoningParser(tok).reasoning_tokens(interleaved, False) == 0
    )
    call = tok.token_to_id("<tool_call>")
    assert qwen3.grammar_gate().after == {qwen3.end_id} and qwen3.grammar_gate().at == {call}
    assert r1.grammar_gate().at == frozenset()
    assert not qwen3.special  # Qwen 3's markers are ordinary added tokens: in the text


def test_a_tokenizer_without_the_markers_is_refused_naming_them(default_lm):
    for name, cls in REASONING_PARSERS.items():
        marker = "<think>" if name in THINK_PARSERS else "<|start|>" if name == "openai_gptoss" else cls.start
        with pytest.raises(
            ValueError, match=f"--reasoning-parser {name}: the tokenizer has no '{re.escape(marker)}' token"
        ):
            cls(default_lm.tokenizer)
