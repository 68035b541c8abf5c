"""Constraints as one bitmask and one bias list (constraints/device_masks.py, how a GPU step
applies them where its logits lie) draw what the rows edited on the host draw: the same tokens and
logprobs for every mix of logit_bias, allowed_token_ids, bad words, blocked EOS, thinking budgets
and grammars of both backends, greedy and seeded, with a token drawn ahead and not booked yet; the same refusal of
a row with nothing left. Run on the CPU: the device path is forced (`as_masks=True`)."""

from __future__ import annotations

import random

import pytest
import torch

from prefixkv import SamplingParams
from prefixkv.constraints.grammar import GrammarEngine
from prefixkv.constraints.token_constraints import RequestConstraints, ThinkingBudget, bad_words_token_ids
from prefixkv.engine.sampler import sample
from prefixkv.sampling_params import StructuredOutputsParams

SPECS = [
    StructuredOutputsParams(regex=r" [A-Z][a-z]+, (yes|no)\."),
    StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}),
    StructuredOutputsParams(choice=["red", "green", "blue sky"]),
]


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def grammars(request, default_lm):
    tok = default_lm.tokenizer
    return GrammarEngine(tok, default_lm.config.vocab_size, [tok.eos_token_id], request.param)


def _allowed(mask: torch.Tensor, vocab: int) -> list[int]:
    """The token ids a one-row bitmask allows (token t: bit t & 31 of word t >> 5), ascending; read
    in one vectorised pass (a Python loop over the 49,152 ids took ~0.2 s a call)."""
    ids = torch.arange(vocab)
    return ids[((mask[0, ids >> 5] >> (ids & 31)) & 1).bool()].tolist()


def _batch(seed: int, grammars: GrammarEngine, tok, vocab: int):
    """Rows of random constraints, some walked a few tokens into their grammar (booked), the
    last of them pending where `ahead`; with params, output ids and blocked EOS ids."""
    rng = random.Random(seed)
    budgets = random.Random(seed + 1000)  # apart: the other rows stay what they were
    rows = []
    for _ in range(8):
        kind = rng.randrange(5)
        grammar = None
        outputs = [rng.randrange(vocab) for _ in range(rng.randrange(4))]
        if kind >= 3:  # a grammar, walked along its own greedy path for a few tokens
            grammar = grammars.matcher(grammars.compile(rng.choice(SPECS)))
            outputs = []
            mask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
            for _ in range(rng.randrange(4)):
                grammar.fill(mask)
                allowed = _allowed(mask, vocab)
                token = rng.choice(allowed)
                if token == tok.eos_token_id:
                    break
                grammar.accept(token)
                outputs.append(token)
        words = [rng.choice(["the", "Paris", "is a", " yes", ","]) for _ in range(rng.randrange(3))]
        if outputs and rng.random() < 0.5:  # a two-token word whose first token ends the output
            words.append(tok.decode([outputs[-1], rng.randrange(1000, 2000)]))
        c = RequestConstraints(
            vocab,
            logit_bias={rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(rng.randrange(4))} or None,
            allowed_token_ids=rng.sample(range(vocab), 3000) if kind == 1 else None,
            bad_words=bad_words_token_ids(words, tok) if words else None,
            grammar=grammar,
            budget=_budget(budgets, vocab, outputs),
        )
        greedy = rng.random() < 0.5
        params = SamplingParams(
            temperature=0 if greedy else rng.uniform(0.5, 1.5),
            top_k=rng.choice([-1, 40]),
            logprobs=rng.choice([None, 2]),
            repetition_penalty=rng.choice([1.0, 1.3]),
        )
        eos = {tok.eos_token_id} if rng.random() < 0.3 else None
        rows.append((c if kind else None, params, outputs, eos))
    return rows


def _budget(rng: random.Random, vocab: int, outputs: list[int]) -> ThinkingBudget | None:
    """A thinking budget for some rows: spent already, or about to be, or not yet; its start and
    ends tokens of the output or not."""
    if rng.random() < 0.5:
        return None
    pick = (lambda: rng.choice(outputs)) if outputs and rng.random() < 0.5 else (lambda: rng.randrange(vocab))
    return ThinkingBudget(limit=rng.randrange(4), end=rng.randrange(vocab), ends=frozenset({pick()}), start=pick())


def _draw(rows, logits, seed: int, as_masks: bool, pending: list[int | None]):
    gens = [torch.Generator().manual_seed(seed + i) for i in range(len(rows))]
    outputs = [out + ([p] if p is not None else []) for (_, _, out, _), p in zip(rows, pending)]
    eos = [e for *_, e in rows]
    got = sample(
        logits,
        [p for _, p, _, _ in rows],
        gens,  # type: ignore[arg-type]
        [[1, 2, 3]] * len(rows),
        outputs,
        eos if any(e is not None for e in eos) else None,
        [c for c, *_ in rows],
        as_masks=as_masks,
    ).result()
    return got.token_ids, got.logprobs, got.top_logprobs


@pytest.mark.parametrize("seed", range(6))
def test_masks_draw_what_host_edits_draw(grammars, default_lm, seed):
    tok = default_lm.tokenizer
    vocab = default_lm.config.vocab_size
    rows = _batch(seed, grammars, tok, vocab)
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed)) * 4
    booked = [None] * len(rows)
    assert _draw(rows, logits, seed, True, booked) == _draw(rows, logits, seed, False, booked)
    # a token drawn ahead, not booked yet: each grammar row takes one of its allowed tokens
    pending: list[int | None] = []
    for c, *_ in rows:
        if c is None or c.grammar is None:
            pending.append(None)
            continue
        mask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
        c.grammar.fill(mask)
        allowed = _allowed(mask, vocab)
        going_on = [t for t in allowed if t != tok.eos_token_id]  # a grammar ended draws nothing more
        pending.append(random.Random(seed).choice(going_on) if going_on else None)
    want = _draw(rows, logits, seed, False, pending)
    assert _draw(rows, logits, seed, True, pending) == want
    before = [c.grammar.num_accepted if c is not None and c.grammar else None for c, *_ in rows]
    # ... and equals a grammar that booked that token
    for (c, *_), token in zip(rows, pending):
        if token is not None and c is not None and c.grammar is not None:
            c.grammar.accept(token)
    assert _draw(rows, logits, seed, False, pending) == want
    assert [c.grammar.num_accepted if c is not None and c.grammar else None for c, *_ in rows] == [
        n + (p is not None) if n is not None else None for n, p in zip(before, pending)
    ]


def test_pending_tokens_are_rolled_back(grammars, default_lm):
    """A mask filled after pending tokens leaves the matcher where it was: the same mask before
    and after, and the pending tokens can still be booked."""
    vocab = default_lm.config.vocab_size
    tok = default_lm.tokenizer
    g = grammars.matcher(grammars.compile(StructuredOutputsParams(choice=["blue sky", "red"])))
    ids = tok.encode("blue sky", add_special_tokens=False)
    words = (vocab + 31) // 32
    first, after, again = (torch.zeros((1, words), dtype=torch.int32) for _ in range(3))
    g.fill(first)
    assert g.fill(after, ids[:1])
    g.fill(again)
    assert torch.equal(first, again) and not torch.equal(first, after)
    # pending tokens that end the grammar: nothing to constrain, the matcher untouched
    untouched = after.clone()
    assert not g.fill(after, [*ids, tok.eos_token_id])
    assert torch.equal(after, untouched)
    assert not g.fill(after, [ids[0], ids[0]] if len(ids) > 1 and ids[1] != ids[0] else [tok.eos_token_id])
    for t in ids:
        g.accept(t)
    assert g.num_accepted == len(ids)


@pytest.mark.parametrize("as_masks", [False, True])
def test_a_row_with_nothing_left_is_refused_on_both_paths(default_lm, as_masks):
    vocab = default_lm.config.vocab_size
    eos = default_lm.tokenizer.eos_token_id
    c = RequestConstraints(vocab, allowed_token_ids=[eos])
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0)]
    logits = torch.randn(2, vocab)
    with pytest.raises(ValueError, match="no token is allowed"):
        sample(logits, params, [None, None], [[1]] * 2, [[], []], [None, {eos}], [None, c], as_masks=as_masks)
    # EOS alone allowed and not blocked: drawn
    got = sample(logits, params, [None, None], [[1]] * 2, [[], []], None, [None, c], as_masks=as_masks).result()
    assert got.token_ids[1] == eos


@pytest.mark.parametrize("seed", range(3))
def test_one_batch_fill_equals_each_grammar_filled_alone(grammars, default_lm, seed):
    """A step's grammar masks come from one batch call on the backend's threads (fill_next): the
    same bits as each matcher filling its own row, pending tokens included."""
    from prefixkv.constraints.grammar import fill_next

    tok = default_lm.tokenizer
    vocab = default_lm.config.vocab_size
    rows = [
        r for r in _batch(seed, grammars, tok, vocab) + _batch(seed + 10, grammars, tok, vocab) if r[0] and r[0].grammar
    ]
    assert len(rows) >= 3
    words = (vocab + 31) // 32
    pending = []
    for c, *_ in rows:  # a token in flight for every other row: the first one its grammar allows
        alone = torch.zeros((1, words), dtype=torch.int32)
        c.grammar.fill(alone)
        allowed = [t for t in _allowed(alone, vocab) if t != tok.eos_token_id]
        pending.append(allowed[:1] if len(pending) % 2 and allowed else [])
    batch = torch.full((len(rows) + 2, words), 7, dtype=torch.int32)
    at = [i + 2 for i in range(len(rows))][::-1]  # rows of the bitmask out of order
    assert fill_next([c.grammar for c, *_ in rows], pending, batch, at) == [True] * len(rows)
    for (c, *_), p, row in zip(rows, pending, at):
        alone = torch.zeros((1, words), dtype=torch.int32)
        assert c.grammar.fill(alone, p)
        assert torch.equal(batch[row], alone[0])
    assert (batch[:2] == 7).all()  # rows not named are left alone
