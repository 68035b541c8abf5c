"""Token sampling for one step's batch: penalties, per-request constraints (logit_bias,
allowed_token_ids, bad_words, grammars: prefixkv/constraints/), temperature, top-k, top-p, min-p,
per-request seeds, and log-probabilities of the raw distribution."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..constraints.device_masks import NOTHING_ALLOWED, apply_on_device
from ..constraints.token_constraints import grammar_masks
from ..model.host_copy import HostCopies, tensor_on, to_device
from ..sampling_params import SamplingParams

if TYPE_CHECKING:
    from ..constraints.token_constraints import RequestConstraints


def rows_finite(logits: torch.Tensor) -> torch.Tensor:
    """[B] whether each row of `logits` [B, vocab] is finite: a row sums to a finite number iff every
    logit in it is (real logits are far from overflowing a float32 sum); one pass, ~6x cheaper than
    isfinite() over the whole matrix."""
    return torch.isfinite(logits.sum(dim=-1))


def mark_unfinished(tokens: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """`tokens` with -1 in the rows whose logits were not finite: what the host reads back, one
    copy for both."""
    return torch.where(finite, tokens, -1)


def plain_greedy(params: list[SamplingParams]) -> bool:
    """Whether a batch's tokens are its logits' argmax and nothing else is asked of them (no
    penalties, no logprobs; the caller knows of constraints and blocked EOS)."""
    return all(p.greedy and not p.penalized and p.logprobs is None for p in params)


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # logprob of each sampled token (None when nobody asked)
    top_logprobs: list[list[tuple[int, float]]] | None  # per row: (token, logprob), best first
    ranks: list[int] | None = None  # rank of each sampled token in the raw distribution (1 = best)


@dataclass
class SampledTensors:
    """A batch's draws still on the logits' device: nothing here has waited for the device, so
    a GPU step can be followed by the next one before these are read (`result()` reads them)."""

    tokens: torch.Tensor  # [B] the sampled token ids
    num_rows: int
    chosen: torch.Tensor | None = None  # [B] each sampled token's logprob (None: nobody asked)
    ranks: torch.Tensor | None = None  # [B] its rank (1 = best)
    # top logprobs: per group, its rows, how many each asked for, and the group's (values,
    # indices) [rows, k >= each row's], best first (score_rows)
    tops: list[tuple[list[int], list[int], torch.Tensor, torch.Tensor]] | None = None

    host: HostCopies | None = None  # their copies on the way to the host (start_reading)
    marked: torch.Tensor | None = None  # mark_unfinished(tokens, finite), where made already

    def start_reading(self, finite: torch.Tensor | None = None) -> None:
        """Copy the draws to the host now, in stream order: `result()` then waits for this step's
        sampling alone, not for a step launched after it. `finite` [B] (whether each row's logits
        were): its rows' tokens read as -1, in the same copy."""
        if finite is None:
            tensors = [self.tokens]
        else:
            tensors = [self.marked if self.marked is not None else mark_unfinished(self.tokens, finite)]
        if self.chosen is not None and self.ranks is not None and self.tops is not None:
            tensors += [self.chosen, self.ranks]
            for _, _, vals, idx in self.tops:
                tensors += [vals, idx]
        self.host = HostCopies(tensors)

    def result(self) -> SampleResult:
        if self.host is None:
            self.start_reading()
        assert self.host is not None
        read = self.host.wait()
        tokens: list[int] = read[0].tolist()
        if self.chosen is None or self.ranks is None or self.tops is None:
            return SampleResult(tokens, None, None)
        top: list[list[tuple[int, float]]] = [[] for _ in range(self.num_rows)]
        for g, (members, counts, _, _) in enumerate(self.tops):
            vals, idx = read[3 + 2 * g], read[4 + 2 * g]
            for row, k, i, v in zip(members, counts, idx.tolist(), vals.tolist()):
                top[row] = list(zip(i[:k], v[:k]))
        return SampleResult(tokens, read[1].tolist(), top, read[2].tolist())


def apply_penalties(
    x: torch.Tensor,
    rows: list[int],
    params: list[SamplingParams],
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
) -> None:
    """vLLM's penalties on `rows` of `x` [B, vocab], in place: a repetition penalty on every
    token of the prompt or the output so far (divides a positive logit, multiplies a negative
    one), presence and frequency penalties on the output's tokens (once, and per occurrence).
    Every row's tokens become indices into the flattened batch, so the whole batch takes a few
    operations over the tokens seen rather than over the vocabulary. The tokens are counted on
    the host (the lists are there): nothing here waits for the device, so a step scheduled ahead
    can sample penalized rows while the device computes."""
    B, V = x.shape
    dev = x.device
    flat = x.view(-1)
    rep = [r for r in rows if params[r].repetition_penalty != 1.0]
    if rep:
        seen = np.unique(_flat_ids(rep, [prompt_ids[r] for r in rep], [output_ids[r] for r in rep], V))
        penalty = _by_row(B, rep, [params[r].repetition_penalty for r in rep])[seen // V]
        at, by = _on(seen, dev), _on(penalty, dev)
        vals = flat[at]
        flat[at] = torch.where(vals > 0, vals / by, vals * by)
    counted = [r for r in rows if (params[r].presence_penalty or params[r].frequency_penalty) and output_ids[r]]
    if counted:
        ids, counts = np.unique(_flat_ids(counted, [output_ids[r] for r in counted], [], V), return_counts=True)
        row_of = ids // V
        freq = _by_row(B, counted, [params[r].frequency_penalty for r in counted])[row_of]
        presence = _by_row(B, counted, [params[r].presence_penalty for r in counted])[row_of]
        # float32 on the host as on the device: a product, then a sum, each rounded once
        flat[_on(ids, dev)] -= _on(freq * counts.astype(np.float32) + presence, dev)


def _flat_ids(rows: list[int], tokens: list[list[int]], more: list[list[int]], V: int) -> np.ndarray:
    """Row r's token t as r x V + t, every row's `tokens` (and `more`, where given: a list a row)
    in one int64 array on the host."""
    parts = [np.asarray(t, dtype=np.int64) + r * V for r, t in zip(rows, tokens)]
    parts += [np.asarray(t, dtype=np.int64) + r * V for r, t in zip(rows, more)]
    return np.concatenate(parts)


def _by_row(num_rows: int, rows: list[int], values: list[float]) -> np.ndarray:
    """A float32 value per row (0 for rows not listed), for indexing by row on the host."""
    out = np.zeros(num_rows, dtype=np.float32)
    out[rows] = values
    return out


def _on(values: np.ndarray, dev: torch.device) -> torch.Tensor:
    """A host array on `dev`, copied in stream order."""
    return to_device(torch.from_numpy(values), dev)


# Inverse-CDF draws over more than four blocks of this many tokens go block by block: float64
# prefix sums of the block totals, then of the one block drawn, not of the whole row.
DRAW_BLOCK = 256


def _pick(weights: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw of one index per row of `weights` [B, N] (>= 0, each row with a positive
    entry) from uniforms `r` [B] in [0, 1): index i with probability weights[i] / row sum. The
    prefix sums are float64 (a float32 sum over a vocabulary rounds small weights away), taken
    blockwise over long rows."""
    B, N = weights.shape
    if N <= 4 * DRAW_BLOCK:
        return _search(weights.double().cumsum(1), r)
    nb = -(-N // DRAW_BLOCK)
    if nb * DRAW_BLOCK != N:
        weights = torch.nn.functional.pad(weights, (0, nb * DRAW_BLOCK - N))
    blocks = weights.view(B, nb, DRAW_BLOCK)
    block_cum = blocks.sum(-1).double().cumsum(1)
    block = _search(block_cum, r)
    rows = torch.arange(B, device=weights.device)
    before = torch.where(block > 0, block_cum[rows, (block - 1).clamp(min=0)], 0.0)
    inside = block_cum[rows, block] - before
    r_inner = ((r.double() * block_cum[:, -1] - before) / inside).clamp(0.0, 1.0)
    return block * DRAW_BLOCK + _search(blocks[rows, block].double().cumsum(1), r_inner)


def _search(cum: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """The first index whose prefix sum exceeds r x total, never past the last positive weight."""
    total = cum[:, -1:].contiguous()
    idx = torch.searchsorted(cum, r.to(cum.dtype)[:, None] * total, right=True)
    last = torch.searchsorted(cum, total)  # where the sum reaches its total: the last positive weight
    return torch.minimum(idx, last).squeeze(1)


def _draw(x: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> torch.Tensor:
    """Sample one token per row of logits `x` [B, vocab] (penalties and constraints applied): one
    uniform per row from the row's own generator picks a token in proportion to
    `filtered_weights` - the same draws whatever else is in the batch."""
    # the uniforms, 1/temperature and the min-p floors: one copy to the device for the three
    per_row = torch.cat([uniforms(generators)[None], _scales_and_floors(params)])
    on_device = to_device(per_row, x.device)
    return _pick(filtered_weights(x, params, on_device[1:]), on_device[0])


def _scales_and_floors(params: list[SamplingParams]) -> torch.Tensor:
    """[2, B] float64 on the host: each row's 1/temperature and min-p floor (log(min_p), -inf
    without min-p)."""
    return torch.tensor(
        [
            [1.0 / p.temperature for p in params],
            [math.log(p.min_p) if p.min_p > 0.0 else -math.inf for p in params],
        ],
        dtype=torch.float64,
    )


def uniforms(generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One float64 uniform per row [B] on the host, each from its row's generator in row order.
    Rows that share a generator (the engine's default one, for every unseeded request) take theirs
    in one draw: torch fills a CPU tensor from its generator serially, so n values drawn at once
    are the n values drawn one at a time, and leave the generator in the same state
    (tests/engine/test_sampler.py) - one operator where a batch of 256 took 256."""
    rows_of: dict[int, list[int]] = {}
    for row, g in enumerate(generators):
        rows_of.setdefault(id(g), []).append(row)
    if len(rows_of) == 1:
        return torch.rand(len(generators), generator=generators[0], dtype=torch.float64)
    r = np.empty(len(generators), dtype=np.float64)
    for rows in rows_of.values():
        r[rows] = torch.rand(len(rows), generator=generators[rows[0]], dtype=torch.float64).numpy()
    return torch.from_numpy(r)


def filtered_weights(
    x: torch.Tensor, params: list[SamplingParams], scales_floors: torch.Tensor | None = None
) -> torch.Tensor:
    """Each row's unnormalized sampling probabilities [B, vocab] (0 for a filtered-out token).
    `scales_floors`: `_scales_and_floors(params)` on x's device, where the caller copied them (None:
    copied here).

    Temperature, then top-k, min-p and top-p - top-p over what the other two left (they commute),
    as in vLLM. Each filter keeps the tokens at or above a value of the scaled logits, so each
    raises the row's floor: min-p's is log(min_p) below the best, top-k's the k-th best value, and
    top-p's the value of the last token of the shortest run (in descending order) whose mass
    reaches top_p of what the others left. Ties at a floor all stay, so the kept set never depends
    on how a sort orders equal values."""
    B, V = x.shape
    dev = x.device
    if scales_floors is None:
        scales_floors = to_device(_scales_and_floors(params), dev)
    # (rounded to x's dtype as a list of Python floats would be: the same bits; its own memory)
    scale, floor = scales_floors.to(x.dtype, copy=True)[:, :, None]
    z = x - x.amax(dim=1, keepdim=True)  # the best token at 0: every weight exp(z) is at most 1
    if any(p.temperature != 1.0 for p in params):
        z *= scale
    weights = torch.exp(z)
    # min-p keeps p >= min_p * p_max, i.e. z >= log(min_p): no softmax needed
    top_k = [p.top_k if 0 < p.top_k < V else 0 for p in params]
    if any(top_k):
        rows = [i for i, k in enumerate(top_k) if k]
        some = slice(None) if len(rows) == B else to_device(torch.tensor(rows), dev)
        ranked = torch.topk(z[some], max(top_k[i] for i in rows)).values
        kth = ranked.gather(1, to_device(torch.tensor([[top_k[i] - 1] for i in rows]), dev))
        floor[some] = torch.maximum(floor[some], kth)
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if nucleus:
        which = slice(None) if len(nucleus) == B else tensor_on(nucleus, dev)
        top_p = tensor_on([params[i].top_p for i in nucleus], dev, torch.float64)
        # a CPU sorts only the candidates (a data-dependent set: a GPU would wait to learn its
        # size); a GPU sorts whole rows in one launch and never makes the host wait
        nucleus_floors = _nucleus_floors if dev.type == "cpu" else _nucleus_floors_sorted
        floor[which] = nucleus_floors(z[which], weights[which], floor[which], top_p)
    return weights.masked_fill_(z < floor, 0.0)


def _nucleus_floors(z: torch.Tensor, weights: torch.Tensor, floor: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p's floors [N, 1] for rows `z` [N, vocab] (each row's best at 0) with `weights` =
    exp(z) and the floors [N, 1] the other filters set: per row the value of the last token, in
    descending order, whose preceding mass is below top_p of the mass above the floor (the best
    token at least).

    Only tokens of weight at least (1 - top_p) x mass / vocab are sorted: the mass at or below a
    lighter token is under (1 - top_p) x mass, so the mass before it already reaches top_p x mass.
    Every row's candidates are sorted together (by value, then stably by row), so the step costs
    the same few tensor operations for one row or a batch."""
    n, V = z.shape
    above = torch.where(z >= floor, weights, 0.0) if bool((floor > -math.inf).any()) else weights
    mass = above.sum(dim=1).double()
    bound = top_p * mass
    rows, cols = torch.nonzero(above >= ((1.0 - top_p) * mass / V)[:, None].to(above.dtype), as_tuple=True)
    vals = z[rows, cols]
    order = torch.sort(vals, descending=True, stable=True).indices
    order = order[torch.sort(rows[order], stable=True).indices]  # grouped by row, each descending
    rows, vals = rows[order], vals[order]
    w = torch.exp(vals).double()  # the same values as `weights`: exp of the same inputs
    counts = torch.bincount(rows, minlength=n)
    starts = torch.cumsum(counts, 0) - counts
    cum = torch.cumsum(w, 0)
    before = cum - w - (cum - w)[starts][rows]  # the mass before each candidate within its row
    kept = torch.bincount(rows, weights=(before < bound[rows]).double(), minlength=n).long().clamp(min=1)
    return torch.maximum(floor, vals[starts + kept - 1][:, None])


def _nucleus_floors_sorted(
    z: torch.Tensor, weights: torch.Tensor, floor: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """`_nucleus_floors` by a sort of whole rows: every shape known before the device runs, so
    no step of it waits for the device (the candidates' count would)."""
    vals, order = torch.sort(z, dim=1, descending=True, stable=True)
    return _nucleus_floors_of_sorted(z, vals, order, weights, floor, top_p)


def _nucleus_floors_of_sorted(
    z: torch.Tensor,
    vals: torch.Tensor,
    order: torch.Tensor,
    weights: torch.Tensor,
    floor: torch.Tensor,
    top_p: torch.Tensor,
) -> torch.Tensor:
    """`_nucleus_floors_sorted` given z's rows sorted (`vals`, `order`: descending, stable). The
    tokens under a floor sort after every other (they are the row's lowest values) and weigh 0
    here, so the kept run is the one a sort of the rows without them gives; where the count runs
    past it, the value read is under the floor, which the result's maximum keeps."""
    above = weights.masked_fill(z < floor, 0.0)
    bound = top_p * above.sum(dim=1).double()  # summed in the rows' own order, as _nucleus_floors sums
    w = above.gather(1, order).double()
    before = torch.cumsum(w, 1) - w  # the mass before each token within its row
    kept = (before < bound[:, None]).sum(dim=1).clamp(min=1)
    return torch.maximum(floor, vals.gather(1, (kept - 1)[:, None]))


# The rows of `draw_fixed`'s per-row parameters [SAMPLE_PARAMS, rows] (float64): the uniform, 1 /
# temperature, min-p's floor log(min_p), top-k (0: none), top-p, and 1 for a greedy row
SAMPLE_PARAMS = 6


def fixed_params(params: list[SamplingParams], vocab: int, generators: list[torch.Generator], out: np.ndarray) -> bool:
    """Write each row's parameters for `draw_fixed` into `out` [SAMPLE_PARAMS, >= rows] (host
    memory), drawing the uniforms of the rows `sample` would draw from, from their generators in
    row order (as `sample` does); return whether a row asks for top-k or top-p (the sorted
    variant). A greedy row gets values under which its unused draw stays well-defined. Each
    parameter as `_scales_and_floors` and `filtered_weights` compute it (Python's float division
    and math.log: the same float64 values), a row of `out` at a time."""
    n = len(params)
    greedy = [p.greedy for p in params]
    top_k = [0 if g or not 0 < p.top_k < vocab else p.top_k for p, g in zip(params, greedy)]
    top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
    rows = out[:, :n]
    rows[1] = [1.0 if g else 1.0 / p.temperature for p, g in zip(params, greedy)]
    rows[2] = [math.log(p.min_p) if p.min_p > 0.0 and not g else -math.inf for p, g in zip(params, greedy)]
    rows[3] = top_k
    rows[4] = top_p
    rows[5] = greedy
    if not any(greedy):
        rows[0] = uniforms(generators).numpy()
    else:
        drawn = [i for i, g in enumerate(greedy) if not g]
        rows[0] = 0.0
        if drawn:
            rows[0, drawn] = uniforms([generators[i] for i in drawn]).numpy()
    return any(top_k) or min(top_p) < 1.0


def draw_fixed(logits: torch.Tensor, params: torch.Tensor, sort: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample`'s tokens for rows of `logits` [B, vocab] (float32) without penalties, constraints
    or blocked EOS (their logprobs, where asked: `score_rows` over the tokens drawn), every shape
    fixed by the inputs' (what a CUDA graph records): each row's parameters in `params`
    [SAMPLE_PARAMS, B] (fixed_params), every filter computed for every row and kept where the row
    asks for it, so each row's token is the one `sample` draws (tests/engine/test_sampler.py).
    `sort`: a row asks for top-k or top-p (else they are skipped: the sort is most of the work).
    Returns the tokens and the tokens marked (mark_unfinished): a row whose logits are not finite
    is drawn from zeros."""
    finite = rows_finite(logits)
    x = torch.where(finite[:, None], logits, 0.0)
    u, scale, floor, top_k, top_p, greedy = params
    floor = floor.to(x.dtype)[:, None]
    z = x - x.amax(dim=1, keepdim=True)
    z *= scale.to(x.dtype)[:, None]  # x 1.0 where `sample` skips it: the same bits
    weights = torch.exp(z)
    if sort:
        vals, order = torch.sort(z, dim=1, descending=True, stable=True)
        k = top_k.long()
        kth = vals.gather(1, (k.clamp(min=1) - 1)[:, None])  # the k-th best value, as topk finds it
        floor = torch.where((k > 0)[:, None], torch.maximum(floor, kth), floor)
        nucleus = _nucleus_floors_of_sorted(z, vals, order, weights, floor, top_p)
        floor = torch.where((top_p < 1.0)[:, None], nucleus, floor)
    drawn = _pick(weights.masked_fill_(z < floor, 0.0), u)
    tokens = torch.where(greedy > 0.0, x.argmax(dim=-1), drawn)
    return tokens, mark_unfinished(tokens, finite)


# Top logprobs are computed this many a row (vLLM's default max_logprobs) for every row asking for
# at most as many, and each row's list cut to its own count: a row's list (among equal logprobs,
# which tokens) never depends on its batch, nor on whether the draws' graphs or the eager sampler
# scored it (graph_sampling.py computes the same top-k over every row).
TOP_LOGPROBS = 20


def top_logprobs_k(vocab: int) -> int:
    """The top-k computed for a row asking for at most TOP_LOGPROBS logprobs."""
    return min(TOP_LOGPROBS, vocab)


def score_rows(
    logits: torch.Tensor, tokens: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's raw logprob of its token, that token's rank, and the row's top `k` logprobs
    (values, indices), from `logits` [B, vocab] (float32) and `tokens` [B], every shape fixed (what
    the draws' graphs record)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen, ranks = _chosen_and_ranks(logprobs, tokens)
    vals, idx = torch.topk(logprobs, k)
    return chosen, ranks, vals, idx


def _chosen_and_ranks(logprobs: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's logprob of its token [N] and that token's rank (1 = best) under `logprobs` [N, vocab]."""
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    return chosen, (logprobs > chosen[:, None]).sum(dim=-1) + 1


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    eos_ids: list[set[int] | None] | None = None,
    constraints: list[RequestConstraints | None] | None = None,
    as_masks: bool | None = None,
) -> SampledTensors:
    """Sample one token per row of `logits` [N, vocab] (float32), the results left on the logits'
    device until `.result()` reads them: nothing here waits for the device. Constraints and blocked
    EOS ids edit the rows on the host where the logits are there, and on their device through one
    bitmask otherwise (`as_masks` forces either: constraints/device_masks.py); penalties take the tokens
    so far from `prompt_ids` and `output_ids` on the host. A row whose constraints leave it no
    token raises ValueError (the runner then finds it row by row)."""
    logits = logits.float()
    n = len(params)
    want_logprobs = any(p.logprobs is not None for p in params)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    all_greedy_plain = all(p.greedy and not p.penalized for p in params) and not eos_ids and not constraints
    if all_greedy_plain:
        tokens = logits.argmax(dim=-1)
    else:
        x = logits
        penalized = [row for row, p in enumerate(params) if p.penalized]
        if penalized or constraints or eos_ids:
            x = logits.clone(memory_format=torch.contiguous_format)  # edited in place: never the caller's logits
        if penalized:
            apply_penalties(x, penalized, params, prompt_ids, output_ids)
        on_host = constraints or eos_ids
        if on_host and (x.device.type != "cpu" if as_masks is None else as_masks):
            apply_on_device(x, constraints, output_ids, eos_ids)
            on_host = None
        grammars = grammar_masks(constraints, output_ids) if on_host and constraints else {}
        for row in range(n) if on_host else ():
            c = constraints[row] if constraints else None
            blocked = eos_ids[row] if eos_ids else None
            xr = x[row]
            if c is not None:
                c.apply(xr, output_ids[row], grammars.get(row))
            if blocked:  # min_tokens not reached: EOS may not be drawn
                xr[list(blocked)] = float("-inf")
            if c is not None and float(xr.max()) == float("-inf"):  # this row fails alone
                raise ValueError(NOTHING_ALLOWED)
        drawn = [row for row, p in enumerate(params) if not p.greedy]
        if len(drawn) == n:
            tokens = _draw(x, params, generators)
        else:
            tokens = x.argmax(dim=-1)
            if drawn:
                rows = to_device(torch.tensor(drawn), x.device)
                tokens[rows] = _draw(x[rows], [params[i] for i in drawn], [generators[i] for i in drawn])
    if raw_logprobs is None:
        return SampledTensors(tokens, n)
    dev = raw_logprobs.device
    chosen, ranks = _chosen_and_ranks(raw_logprobs, tokens)
    shared = top_logprobs_k(raw_logprobs.shape[1])
    groups: dict[int, list[int]] = {}  # rows by the top-k computed for them
    for row, p in enumerate(params):
        if p.logprobs:
            groups.setdefault(max(p.logprobs, shared), []).append(row)
    tops = []
    for k, members in groups.items():
        of_k = raw_logprobs if len(members) == n else raw_logprobs[to_device(torch.tensor(members), dev)]
        vals, idx = torch.topk(of_k, k)
        tops.append((members, [params[row].logprobs or 0 for row in members], vals, idx))
    return SampledTensors(tokens, n, chosen, ranks, tops)
