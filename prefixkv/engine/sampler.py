"""Token sampling for one step's batch: penalties, per-request constraints (logit_bias,
allowed_token_ids, bad_words, grammars: prefixkv/constraints/), temperature, top-k, top-p, min-p,
per-request seeds, and log-probabilities of the raw distribution."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..sampling_params import SamplingParams

if TYPE_CHECKING:
    from ..constraints.token_constraints import RequestConstraints


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # logprob of each sampled token (None when nobody asked)
    top_logprobs: list[list[tuple[int, float]]] | None  # per row: (token, logprob), best first
    ranks: list[int] | None = None  # rank of each sampled token in the raw distribution (1 = best)


def _apply_penalties(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]
) -> None:
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and output_ids:
        ids, counts = torch.unique(torch.tensor(output_ids, device=logits.device), return_counts=True)
        logits[ids] -= params.frequency_penalty * counts.to(logits.dtype) + params.presence_penalty


def _filter(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Scaled, filtered logits of one row (−inf where a token may not be drawn)."""
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= params.top_p
        # the first token always stays: a top_p below float32's least value (5e-324) compares as 0.0,
        # and 0 >= 0 would drop every token (found by tests/server/test_fuzz.py)
        drop[0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


def score_tokens(
    logits: torch.Tensor, targets: list[int], k: int
) -> tuple[list[float], list[int], list[list[tuple[int, float]]]]:
    """Log-probabilities of given next tokens under the raw distribution of each row of `logits`
    [N, vocab]: each target's logprob and rank (1 = best), and the row's top `k` (token, logprob)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs[torch.arange(len(targets)), torch.tensor(targets)]
    ranks = ((logprobs > chosen[:, None]).sum(dim=-1) + 1).tolist()
    top: list[list[tuple[int, float]]] = [[] for _ in targets]
    if k:
        vals, idx = torch.topk(logprobs, k, dim=-1)
        top = [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
    return chosen.tolist(), ranks, top


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    eos_ids: list[set[int] | None] | None = None,
    constraints: list[RequestConstraints | None] | None = None,
) -> SampleResult:
    """Sample one token per row of `logits` [N, vocab] (float32)."""
    logits = logits.float()
    want_logprobs = any(p.logprobs is not None for p in params)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    all_greedy_plain = (
        all(
            p.greedy and p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty
            for p in params
        )
        and not eos_ids
        and not constraints
    )
    if all_greedy_plain:
        tokens = logits.argmax(dim=-1).tolist()
    else:
        tokens = []
        for row, p in enumerate(params):
            x = logits[row].clone()
            _apply_penalties(x, p, prompt_ids[row], output_ids[row])
            c = constraints[row] if constraints else None
            if c is not None:
                c.apply(x, output_ids[row])
            blocked = eos_ids[row] if eos_ids else None
            if blocked:  # min_tokens not reached: EOS may not be drawn
                x[list(blocked)] = float("-inf")
            if c is not None and float(x.max()) == float("-inf"):  # this row fails alone
                raise ValueError(
                    "no token is allowed by this request's constraints (allowed_token_ids, bad_words, "
                    "logit_bias, structured outputs, min_tokens)"
                )
            if p.greedy:
                tokens.append(int(x.argmax()))
                continue
            probs = torch.softmax(_filter(x, p), dim=-1)
            tokens.append(int(torch.multinomial(probs, 1, generator=generators[row])))
    if raw_logprobs is None:
        return SampleResult(tokens, None, None)
    chosen_t = raw_logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]
    ranks = ((raw_logprobs > chosen_t[:, None]).sum(dim=-1) + 1).tolist()
    chosen = chosen_t.tolist()
    top: list[list[tuple[int, float]]] = []
    for row, p in enumerate(params):
        k = p.logprobs or 0
        if k:
            vals, idx = torch.topk(raw_logprobs[row], k)
            top.append(list(zip(idx.tolist(), vals.tolist())))
        else:
            top.append([])
    return SampleResult(tokens, chosen, top, ranks)
