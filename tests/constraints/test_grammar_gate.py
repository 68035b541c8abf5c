"""A grammar behind a gate (constraints/grammar.py `GrammarGate`: vLLM's structured outputs after
the reasoning): free until its opener, the tokens before it never reaching the matcher; from an
`after` opener on, every mask equals an ungated grammar's after the same tokens; an `at` opener is
the grammar's first token, and while closed it is ruled out where the grammar could not begin
with it. Pending tokens (drawn ahead, not booked) open it for the mask only. Both backends."""

from __future__ import annotations

import pytest
import torch

from prefixkv.constraints.grammar import GrammarEngine, GrammarGate, RequestGrammar
from prefixkv.model.tokenizer import Tokenizer
from prefixkv.sampling_params import StructuredOutputsParams

from ..scripted_thinker import write_scripted_thinker


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_hf_folder(str(write_scripted_thinker(tmp_path_factory.mktemp("thinker"))))


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def grammars(request, tok):
    return GrammarEngine(tok, tok.vocab_size, sorted(tok.eos_token_ids), request.param)


def allowed(grammar: RequestGrammar, pending: list[int] = ()) -> set[int]:
    mask = torch.zeros((1, grammar.num_words), dtype=torch.int32)
    assert grammar.fill(mask, pending)
    words = mask[0].tolist()
    return {t for t in range(grammar.num_words * 32) if (words[t >> 5] >> (t & 31)) & 1}


def test_free_until_the_end_then_the_grammar_as_if_ungated(tok, grammars):
    compiled = grammars.compile(StructuredOutputsParams(regex="Yes|No"))
    end, call = tok.token_to_id("</think>"), tok.token_to_id("<tool_call>")
    gate = GrammarGate(after=frozenset({end}), at=frozenset({call}))
    gated, plain = grammars.matcher(compiled, gate), grammars.matcher(compiled)
    everything = set(range(gated.num_words * 32))
    # closed: every token but the call, which "Yes|No" cannot begin with
    assert allowed(gated) == everything - {call}
    for t in tok.encode("<think>Hmm, yes"):  # none reaches the matcher: "Hmm" would break the grammar
        gated.accept(t)
    assert not gated.opened and not gated.is_terminated and gated.num_accepted == len(tok.encode("<think>Hmm, yes"))
    assert allowed(gated) == everything - {call}
    # drawn ahead, not booked: the end and a token after it, for this mask only
    n = tok.encode("N")
    assert allowed(gated, [end, *n]) == allowed(plain, n)
    assert not gated.opened and allowed(gated) == everything - {call}  # rolled back: still closed
    gated.accept(end)
    assert gated.opened and allowed(gated) == allowed(plain)
    for t in n + tok.encode("o"):
        gated.accept(t)
        plain.accept(t)
        assert allowed(gated) == allowed(plain)
    assert gated.is_terminated == plain.is_terminated


def test_an_at_opener_is_the_grammars_first_token(tok, grammars):
    call, end = tok.token_to_id("<tool_call>"), tok.token_to_id("</think>")
    compiled = grammars.compile(StructuredOutputsParams(regex=r"<tool_call>\{\}</tool_call>"))
    gated = grammars.matcher(compiled, GrammarGate(after=frozenset({end}), at=frozenset({call})))
    plain = grammars.matcher(compiled)
    # xgrammar takes the added token for the text it stands for; llguidance takes added tokens as
    # special ones, which a grammar that does not name them never emits: ruled out while closed
    takes_call = plain._matcher.accept_token(call)
    if takes_call:
        plain._matcher.rollback(1)
    assert takes_call == (grammars.backend == "xgrammar")
    assert (call in allowed(gated)) == takes_call
    for t in tok.encode("hm"):
        gated.accept(t)
    if not takes_call:
        return
    assert allowed(gated, [call]) == allowed(plain, [call])
    gated.accept(call)
    plain.accept(call)
    assert gated.opened and allowed(gated) == allowed(plain)
    with pytest.raises(ValueError, match="does not continue"):
        gated.accept(tok.encode("x")[0])


def test_a_run_of_tokens_opens_it_booked_or_pending(tok, grammars):
    """A gate that opens after a run of tokens (gpt-oss's `<|channel|>final<|message|>`): the run
    booked across steps, or partly booked and the rest drawn ahead, opens it; the same tokens
    apart, or the run cut short, do not."""
    compiled = grammars.compile(StructuredOutputsParams(regex="Yes|No"))
    a, b, c = (tok.encode(ch)[0] for ch in "abc")
    gate = GrammarGate(after=frozenset(), after_run=(a, b, c))
    everything = set(range(tok.vocab_size)) | set(range(grammars.matcher(compiled).num_words * 32))
    plain = grammars.matcher(compiled)
    n = tok.encode("N")
    for booked, pending in (([a, b], [c, *n]), ([a], [b, c, *n]), ([], [a, b, c, *n]), ([a, b, c], n)):
        gated = grammars.matcher(compiled, gate)
        for t in booked:
            gated.accept(t)
        assert gated.opened == (len(booked) == 3)
        assert allowed(gated, pending) == allowed(plain, n)
    gated = grammars.matcher(compiled, gate)
    for t in [a, b, b, c, a, c]:  # never a, b, c in a row
        gated.accept(t)
    assert not gated.opened and allowed(gated, [b, *n]) == everything
    assert allowed(gated, [a, b, *n]) == everything  # cut short before c


def test_a_reply_that_may_open_its_reasoning_itself(tok, grammars):
    """`first_unless` (Gemma 4, which opens its channel mid-reply): the reply's first token is the
    grammar's or the opener; answered at once, the grammar runs from the first token; opened,
    the reasoning runs free until its end, as with a reply that starts in reasoning."""
    compiled = grammars.compile(StructuredOutputsParams(regex="Yes|No"))
    start, end, call = (tok.token_to_id(t) for t in ("<think>", "</think>", "<tool_call>"))
    gate = GrammarGate(after=frozenset({end}), at=frozenset({call}), first_unless=frozenset({start}))
    everything = set(range(grammars.matcher(compiled).num_words * 32))
    n = tok.encode("N")
    # the first token: the grammar's first tokens or the opener; drawn ahead, the grammar's
    gated, plain = grammars.matcher(compiled, gate), grammars.matcher(compiled)
    assert allowed(gated) == allowed(plain) | {start} and start not in allowed(plain)
    assert allowed(gated, n) == allowed(plain, n)
    assert allowed(gated, [start, *tok.encode("h")]) == everything - {call}  # opened reasoning: closed
    # answered at once: the grammar's from the first token on
    gated.accept(n[0])
    plain.accept(n[0])
    assert gated.opened and allowed(gated) == allowed(plain)
    # reasoning first: free (but for a call the grammar could not begin with) until its end
    thinking, fresh = grammars.matcher(compiled, gate), grammars.matcher(compiled)
    for t in [start, *tok.encode("Hmm")]:
        thinking.accept(t)
        assert not thinking.opened and allowed(thinking) == everything - {call}
    thinking.accept(end)
    assert thinking.opened and allowed(thinking) == allowed(fresh)
