"""The sampler against a plain reference: the distribution each row is drawn from (temperature,
top-k, min-p, top-p) equals the one a full sort of the vocabulary gives, the inverse-CDF draw
picks each token in proportion to its weight, and a seeded row draws the same token whatever
else is in its batch."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from prefixkv.engine.sampler import (
    DRAW_BLOCK,
    SAMPLE_PARAMS,
    _nucleus_floors,
    _nucleus_floors_sorted,
    _pick,
    draw_fixed,
    filtered_weights,
    fixed_params,
    sample,
    uniforms,
)
from prefixkv.sampling_params import SamplingParams

from ..model.triton_interpreter import device


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The textbook filters over one row, with a full sort: float64 probabilities [vocab]."""
    x = logits.double() / p.temperature
    if 0 < p.top_k < x.numel():
        x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], -math.inf)  # ties at the k-th stay
    if p.min_p > 0:
        probs = torch.softmax(x, -1)
        x = x.masked_fill(probs < p.min_p * probs.max(), -math.inf)
    if p.top_p < 1:
        ordered, order = torch.sort(x, descending=True)
        probs = torch.softmax(ordered, -1)
        keep = probs.cumsum(-1) - probs < p.top_p
        keep[0] = True
        last = ordered[keep][-1]
        x = x.masked_fill(x < last, -math.inf)  # ties with the last kept token stay too
    return torch.softmax(x, -1)


PARAMS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=1.0, top_p=0.99),
    dict(temperature=1.0, top_p=0.5),
    dict(temperature=1.0, top_k=50),
    dict(temperature=0.5, top_k=300, top_p=0.8, min_p=0.01),
    dict(temperature=1.3, min_p=0.05, top_p=0.95),
    dict(temperature=2.0, min_p=0.2),
]


@pytest.mark.parametrize("vocab", [300, 5000, 49152])
@pytest.mark.parametrize("spread", [0.1, 1.0, 6.0])
def test_each_row_is_drawn_from_the_filtered_distribution(vocab, spread):
    gen = torch.Generator().manual_seed(vocab + int(spread * 10))
    logits = torch.randn(len(PARAMS), vocab, generator=gen) * spread
    logits[0, :7] = -math.inf  # constrained-away tokens
    params = [SamplingParams(**kw) for kw in PARAMS]
    weights = filtered_weights(logits.clone(), params).double()
    for row, p in enumerate(params):
        got = weights[row] / weights[row].sum()
        want = reference_probs(logits[row], p)
        assert torch.equal(got > 0, want > 0), (p, int((got > 0).sum()), int((want > 0).sum()))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-9)


def test_ties_at_a_floor_all_stay():
    """Top-k's k-th value and top-p's last value keep every token equal to them, so which tokens
    are kept never depends on how a sort orders equal values."""
    row = torch.full((1, 100), -5.0)
    row[0, [3, 40, 77]] = 2.0  # three tied best tokens
    row[0, [10, 20]] = 1.0
    top2 = filtered_weights(row.clone(), [SamplingParams(temperature=1.0, top_k=2)])[0]
    assert set(torch.nonzero(top2).flatten().tolist()) == {3, 40, 77}
    tiny_p = filtered_weights(row.clone(), [SamplingParams(temperature=1.0, top_p=1e-9)])[0]
    assert set(torch.nonzero(tiny_p).flatten().tolist()) == {3, 40, 77}
    four = filtered_weights(row.clone(), [SamplingParams(temperature=1.0, top_k=4)])[0]
    assert set(torch.nonzero(four).flatten().tolist()) == {3, 40, 77, 10, 20}


@pytest.mark.parametrize("spread", [0.1, 1.0, 6.0])
def test_top_p_floors_by_whole_row_sort_equal_the_candidates(spread):
    """The GPU's top-p (a sort of whole rows: no size the host must wait for) sets each row's
    floor where the CPU's (a sort of the candidates) does, over floors the other filters raised,
    rows of ties and every top_p from almost nothing to almost everything."""
    gen = torch.Generator().manual_seed(int(spread * 10))
    n, V = 12, 5000
    x = torch.randn(n, V, generator=gen) * spread
    x[3] = torch.randint(0, 4, (V,), generator=gen).float()  # four values, thousands of ties
    x[4, :] = 0.0  # one value
    x[5, :100] = -math.inf  # constrained-away tokens
    z = x - x.amax(dim=1, keepdim=True)
    weights = torch.exp(z)
    floors = torch.full((n, 1), -math.inf)
    floors[6:9] = torch.tensor([[-0.5], [-2.0], [-30.0]])  # min-p's or top-k's floors
    floors[9] = torch.topk(z[9], 40).values[-1]
    for top_p in (1e-9, 0.1, 0.5, 0.9, 0.99, 0.999999):
        p = torch.full((n,), top_p, dtype=torch.float64)
        by_candidates = _nucleus_floors(z, weights, floors, p)
        by_sort = _nucleus_floors_sorted(z, weights, floors, p)
        assert torch.equal(by_sort, by_candidates), (top_p, (by_sort != by_candidates).nonzero().tolist())


@pytest.mark.parametrize("n", [7, 4 * DRAW_BLOCK + 1, 6 * DRAW_BLOCK])
def test_the_draw_picks_each_token_in_proportion(n):
    """Uniforms on an even grid: each index is picked round(M x its probability) times, give or
    take one; a zero weight never; through the blockwise path too (n above four blocks)."""
    gen = torch.Generator().manual_seed(n)
    w = torch.rand(n, generator=gen) ** 4
    w[torch.randperm(n, generator=gen)[: n // 3]] = 0.0  # zero weights between positive ones
    w[n - 1] = 0.0  # the last positive weight is not the last index
    w[1] = 1e-7 * float(w.sum())  # a token the grid sees at most once
    M = 20_000
    r = (torch.arange(M, dtype=torch.float64) + 0.5) / M
    picks = _pick(w.expand(M, -1).contiguous(), r)
    counts = torch.bincount(picks, minlength=n).double()
    expected = M * w.double() / w.double().sum()
    assert (counts - expected).abs().max() <= 1.0 + 1e-9
    assert counts[w == 0].sum() == 0
    assert int(picks.max()) < n - 1 and int(picks.min()) >= 0
    # a uniform that rounds up to the total still lands on a positive weight, never past the last
    edge = _pick(w[None], torch.tensor([1.0], dtype=torch.float64))
    assert int(edge) == int(torch.nonzero(w).max())


def test_a_seeded_row_draws_the_same_token_in_any_batch():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 2000, generator=gen) * 3
    mine = SamplingParams(temperature=0.8, top_p=0.9, seed=11)

    def draw(rows: list[int], params: list[SamplingParams]) -> int:
        gens = [torch.Generator().manual_seed(11) if p is mine else torch.Generator().manual_seed(99) for p in params]
        out = sample(logits[rows], params, gens, [[1]] * len(rows), [[2]] * len(rows)).result()
        return out.token_ids[params.index(mine)]

    alone = draw([0], [mine])
    others = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.0)]
    assert draw([1, 0, 2], [others[1], mine, others[2]]) == alone
    assert draw([3, 4, 0, 5], [others[0], others[2], mine, others[1]]) == alone
    assert draw([0, 1], [mine, others[0]]) == alone


def test_penalties_do_not_edit_the_callers_logits():
    logits = torch.randn(2, 500, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    params = [SamplingParams(temperature=1.0, repetition_penalty=1.5), SamplingParams(temperature=0.0)]
    gens = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    sample(logits, params, gens, [[1, 2, 3]] * 2, [[4, 5]] * 2).result()
    assert torch.equal(logits, before)


def test_draws_follow_the_distribution_through_the_generators():
    """Many seeded draws of one row: each kept token's frequency is within five standard errors
    of its probability, and no filtered-out token is ever drawn."""
    logits = torch.randn(1, 1500, generator=torch.Generator().manual_seed(5)) * 2
    p = SamplingParams(temperature=0.9, top_p=0.8)
    want = reference_probs(logits[0], p)
    draws = 4000
    params = [p] * draws
    gens = [torch.Generator().manual_seed(i) for i in range(draws)]
    batch = logits.expand(draws, -1).contiguous()
    tokens = sample(batch, params, gens, [[1]] * draws, [[2]] * draws).result().token_ids
    freq = torch.bincount(torch.tensor(tokens), minlength=1500).double() / draws
    assert freq[want == 0].sum() == 0
    stderr = (want * (1 - want) / draws).sqrt()
    assert ((freq - want).abs() <= 5 * stderr + 1e-12).all()


def reference_penalties(row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """vLLM's penalties on one row, token by token."""
    row = row.clone()
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t in set(output):
        row[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return row


def test_penalties_of_a_batch_equal_each_rows_own():
    """Rows with different penalties (and none) in one batch: each greedy pick is the argmax of
    its own penalized row."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 400, generator=gen)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.7),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.7),
        SamplingParams(temperature=0.0, repetition_penalty=0.6, frequency_penalty=-0.4),
        SamplingParams(temperature=0.0, presence_penalty=2.0),
    ]
    top = logits.topk(6, dim=1).indices.tolist()
    prompts = [row[:3] + [7, 7] for row in top]  # the best tokens seen, so the penalties decide
    outputs = [row[3:] + row[3:4] for row in top]
    outputs[4] = []  # nothing generated yet: presence changes nothing
    gens = [torch.Generator().manual_seed(i) for i in range(5)]
    got = sample(logits, params, gens, prompts, outputs).result().token_ids
    want = [int(reference_penalties(logits[i], p, prompts[i], outputs[i]).argmax()) for i, p in enumerate(params)]
    assert got == want
    assert got[1] == int(logits[1].argmax()) and got[4] == int(logits[4].argmax())
    assert got[0] != int(logits[0].argmax())  # the penalty moved the pick


def test_frequency_counts_each_occurrence():
    """A negative frequency penalty lifts a token by its count: the second best, generated three
    times, overtakes the best, generated once."""
    logits = torch.zeros(1, 50)
    logits[0, 10], logits[0, 20] = 3.0, 2.0
    params = [SamplingParams(temperature=0.0, frequency_penalty=-1.0)]
    out = sample(logits, params, [torch.Generator()], [[1]], [[10, 20, 20, 20]]).result().token_ids
    assert out == [20]
    assert torch.equal(logits[0, [10, 20]], torch.tensor([3.0, 2.0]))  # the caller's logits untouched


def test_logprobs_of_a_batch_are_each_rows_own():
    """Rows asking for different numbers of top logprobs (and none) in one batch: each gets its
    own row's best k, its sampled token's logprob and rank under the raw distribution."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(8)) * 2
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, logprobs=5, seed=1),
        SamplingParams(temperature=0.0, logprobs=3),
    ]
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    out = sample(logits, params, gens, [[1]] * 4, [[2]] * 4).result()
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None and out.ranks is not None and out.top_logprobs is not None
    for row, p in enumerate(params):
        token = out.token_ids[row]
        assert out.logprobs[row] == pytest.approx(float(raw[row, token]))
        assert out.ranks[row] == int((raw[row] > raw[row, token]).sum()) + 1
        k = p.logprobs or 0
        vals, idx = torch.topk(raw[row], k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert [t for t, _ in out.top_logprobs[row]] == idx.tolist()
        assert [v for _, v in out.top_logprobs[row]] == pytest.approx(vals.tolist())
    assert out.ranks[0] == 1 and out.ranks[3] == 1  # greedy: the best token


def test_uniforms_are_each_rows_own_draws_in_row_order():
    """Rows sharing a generator take their uniforms in one draw: the values, and each generator's
    state after, are those of one draw a row in row order (a seeded request's generator is its own)."""
    shared, a, b = (torch.Generator().manual_seed(s) for s in (1, 2, 3))
    rows = [shared, a, shared, shared, b, shared]
    copies = {id(g): torch.Generator().manual_seed(s) for g, s in ((shared, 1), (a, 2), (b, 3))}
    want = torch.stack([torch.rand((), generator=copies[id(g)], dtype=torch.float64) for g in rows])
    assert torch.equal(uniforms(rows), want)
    for g in (shared, a, b):  # the next draws agree too
        assert torch.equal(torch.rand(3, generator=g), torch.rand(3, generator=copies[id(g)]))
    one = torch.Generator().manual_seed(9)
    assert torch.equal(
        uniforms([one] * 300), torch.rand(300, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    )


FIXED_CASES = [
    [dict(temperature=1.0)],
    [dict(temperature=0.7), dict(temperature=0), dict(temperature=1.3, min_p=0.1)],  # no sort
    [dict(temperature=0.8, top_p=0.9)],
    [dict(temperature=0.7, top_p=0.9), dict(temperature=0), dict(temperature=1.0), dict(temperature=1.0, top_k=5)],
    [dict(temperature=0.5, top_k=300, top_p=0.8, min_p=0.01), dict(temperature=2.0, min_p=0.2, seed=4)],
    [dict(temperature=1.0, top_p=1e-9), dict(temperature=1.0, top_k=1), dict(temperature=1.0, top_k=10**6)],
    [dict(temperature=0), dict(temperature=0)],  # greedy rows only: the argmax
]


@pytest.mark.parametrize("vocab", [300, 49152])
@pytest.mark.parametrize("case", range(len(FIXED_CASES)))
def test_the_fixed_shape_draw_is_samples_token_for_token(vocab, case):
    """What a CUDA graph replays for a sampled step (`draw_fixed`, every filter computed for every
    row and selected per row) draws each row's token as `sample` does, from the same generators in
    the same order, and leaves them in the same states; over rows of ties, a non-finite row
    (marked -1, drawn from zeros as a deferred read draws it) and unused padding rows. On a GPU
    where there is one (the eager sampler's top-p there sorts whole rows too)."""
    dev = device()
    gen = torch.Generator().manual_seed(vocab + case)
    specs = FIXED_CASES[case]
    params = [SamplingParams(**kw) for kw in specs]
    n, rows = len(params), len(params) + 2  # two padding rows past the batch
    for trial in range(6):
        logits = torch.randn(rows, vocab, generator=gen) * (0.5, 1.0, 4.0)[trial % 3]
        if trial == 3:
            logits[0] = torch.randint(0, 3, (vocab,), generator=gen).float()  # thousands of ties
        if trial == 4 and n > 1:
            logits[1, 5] = math.nan  # not finite: drawn from zeros, marked
        logits = logits.to(dev)
        seeds = [100 * trial + i for i in range(n)]
        eager_gens = [torch.Generator().manual_seed(s) for s in seeds]
        finite = torch.isfinite(logits[:n].sum(-1))
        want = (
            sample(torch.where(finite[:, None], logits[:n], 0.0), params, eager_gens, [[1]] * n, [[2]] * n)
            .result()
            .token_ids
        )
        fixed_gens = [torch.Generator().manual_seed(s) for s in seeds]
        host = np.zeros((SAMPLE_PARAMS, rows))
        host[:, n:] = [[0.0], [1.0], [-math.inf], [0.0], [1.0], [1.0]]  # padding rows: greedy
        sort = fixed_params(params, vocab, fixed_gens, host)
        assert sort == any(0 < p.top_k < vocab or p.top_p < 1.0 for p in params)
        tokens, marked = draw_fixed(logits, torch.from_numpy(host).to(dev), sort)
        assert tokens[:n].tolist() == want, (trial, tokens[:n].tolist(), want)
        assert marked[:n].tolist() == [t if ok else -1 for t, ok in zip(want, finite.tolist())]
        for a, b in zip(eager_gens, fixed_gens):  # the generators moved alike
            assert torch.equal(a.get_state(), b.get_state())
        if not sort and any(0 < p.top_k or p.top_p < 1.0 for p in params):
            continue
        # the sorted variant draws the same tokens where no row asks for it (its filters select nothing)
        again = [torch.Generator().manual_seed(s) for s in seeds]
        fixed_params(params, vocab, again, host)
        assert draw_fixed(logits, torch.from_numpy(host).to(dev), True)[0][:n].tolist() == want


@pytest.mark.parametrize("vocab", [300, 49152])
@pytest.mark.parametrize("case", range(len(FIXED_CASES)))
def test_the_fixed_shape_draw_of_edited_rows_is_samples(vocab, case):
    """Penalized and constrained rows drawn in a graph: their logits edited in place as the
    runner edits them (ModelRunner._edit_for_graph: the penalties, then RULED_OUT where `sample`
    sets -inf), `draw_fixed` draws `sample`'s tokens - allowed sets of one token, of fewer than
    top_k, of most of the vocabulary, with logit_bias, blocked EOS and every penalty."""
    from prefixkv.constraints.device_masks import step_masks
    from prefixkv.constraints.token_constraints import RequestConstraints
    from prefixkv.engine.graph_sampling import RULED_OUT
    from prefixkv.engine.sampler import apply_penalties

    gen = torch.Generator().manual_seed(7 * vocab + case)
    rng = np.random.default_rng(case)
    penalties = [dict(repetition_penalty=1.4), dict(frequency_penalty=0.8, presence_penalty=0.5), {}]
    params = [SamplingParams(**kw, **penalties[i % 3]) for i, kw in enumerate(FIXED_CASES[case])]
    n = len(params)
    prompts = [rng.choice(vocab, 6).tolist() for _ in range(n)]
    outputs = [rng.choice(vocab, 5).tolist() for _ in range(n)]
    for trial in range(6):
        logits = torch.randn(n, vocab, generator=gen) * (0.5, 1.0, 4.0)[trial % 3]
        sizes = [1, 3, vocab // 2, vocab - 5]
        constraints = [
            RequestConstraints(
                vocab,
                logit_bias={int(t): float(rng.uniform(-5, 5)) for t in rng.choice(vocab, 4, replace=False)},
                allowed_token_ids=rng.choice(vocab, sizes[(trial + row) % 4], replace=False).tolist(),
            )
            if (trial + row) % 3
            else None
            for row in range(n)
        ]
        eos = [{0, 1} if (trial + row) % 2 else None for row in range(n)]
        allowed = [
            None if c is None else set(c.blocked.logical_not().nonzero().flatten().tolist()) for c in constraints
        ]
        if any(a is not None and e and a <= e for a, e in zip(allowed, eos)):
            continue  # nothing left in a row: refused on both paths (another test)
        seeds = [100 * trial + i for i in range(n)]
        eager = [torch.Generator().manual_seed(s) for s in seeds]
        want = sample(logits, params, eager, prompts, outputs, eos, constraints, as_masks=False).result().token_ids
        fixed = [torch.Generator().manual_seed(s) for s in seeds]
        host = np.zeros((SAMPLE_PARAMS, n))
        sort = fixed_params(params, vocab, fixed, host)
        edited = logits.clone()
        masks = step_masks(n, vocab, constraints, outputs, eos)
        apply_penalties(edited, [r for r, p in enumerate(params) if p.penalized], params, prompts, outputs)
        masks.apply(edited, RULED_OUT)
        tokens, marked = draw_fixed(edited, torch.from_numpy(host), sort)
        assert tokens.tolist() == want == marked.tolist(), (trial, tokens.tolist(), want)


def test_the_fixed_shape_draw_applies_each_filter_only_where_asked():
    """At chosen uniforms (the last one just under 1: the row's lightest kept token) the fixed-shape
    draw picks what `filtered_weights` keeps, on rows built so that a filter applied where it
    was not asked for shows: a tail that a float32 sum of the row's mass rounds away (top-p = 1
    must not cut it), and rows whose k-th value, min-p floor and nucleus each bind."""
    V = 300
    logits = torch.linspace(-27.0, -28.0, V).repeat(4, 1)  # each tail token weighs ~1e-12 of the best
    logits[:, 0] = 0.0
    logits[2, 1:40] = torch.linspace(-0.1, -3.0, 39)
    logits[3, 1:40] = torch.linspace(-0.1, -3.0, 39)
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, min_p=1e-12),
        SamplingParams(temperature=1.0, top_k=7),
        SamplingParams(temperature=0.9, top_p=0.8),
    ]
    for u in (0.0, 0.3, 0.7, 1.0 - 1e-14):
        host = np.zeros((SAMPLE_PARAMS, len(params)))
        fixed_params(params, V, [torch.Generator()] * len(params), host)
        host[0] = u
        r = torch.full((len(params),), u, dtype=torch.float64)
        want = _pick(filtered_weights(logits.clone(), params), r)
        assert torch.equal(draw_fixed(logits, torch.from_numpy(host), True)[0], want), u
    assert int(want[0]) == V - 1  # the tail kept: top-p 1 cuts nothing


def test_top_logprobs_are_each_rows_own_whatever_scores_them():
    """A row asking for up to TOP_LOGPROBS logprobs gets the first of the TOP_LOGPROBS best (as the
    draws' graphs compute them for every row, graph_sampling.py), one asking for more its own
    count; each row's lists are the same alone as in a batch, and equal `score_rows`' over the
    whole batch (what a graph records)."""
    from prefixkv.engine.sampler import TOP_LOGPROBS, score_rows

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 300, generator=g)
    logits[:2, :40] = 9.0  # ties across the top: which tokens a list names must not move
    params = [
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=0.8, seed=1, logprobs=TOP_LOGPROBS),
        SamplingParams(temperature=0, logprobs=25),
        SamplingParams(temperature=0),
    ]
    got = sample(logits, params, [None, torch.Generator().manual_seed(1), None, None], [[]] * 4, [[]] * 4).result()
    assert [len(t) for t in got.top_logprobs] == [3, TOP_LOGPROBS, 25, 0]
    for row in (0, 1, 2):
        gen = [torch.Generator().manual_seed(1)] if row == 1 else [None]
        alone = sample(logits[row : row + 1], [params[row]], gen, [[]], [[]]).result()
        assert alone.top_logprobs[0] == got.top_logprobs[row] and alone.logprobs[0] == got.logprobs[row]
    tokens = torch.tensor(got.token_ids)
    chosen, ranks, values, ids = score_rows(logits, tokens, TOP_LOGPROBS)
    assert chosen.tolist() == got.logprobs and ranks.tolist() == got.ranks
    for row in (0, 1):
        k = params[row].logprobs
        assert got.top_logprobs[row] == list(zip(ids[row, :k].tolist(), values[row, :k].tolist()))
