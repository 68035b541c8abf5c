"""Which drafted tokens a verification step keeps.

A request with drafts d1..dk has k + 1 sampled rows: row j is sampled as the model's own next
token after d1..dj (penalties and min_tokens see them, ModelRunner._verify_rows). Row j's token is
kept while every draft before it was kept, and a draft is kept where it equals its row's token: a
greedy row keeps it where it is the argmax, a drawn row where the draw picked it. For a draft that
is one token (not a distribution), that is the rejection rule of speculative sampling itself:
accepted with probability p(d), and on rejection a token drawn from p without d. So the outputs are
the model's, greedy or sampled; with a seeded generator they are the very tokens a step without
drafts would draw, once the generator is set back to have drawn one uniform per kept row
(`rewind_generators`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported when a step is verified, not with the engine's options
    import torch


def keep_accepted(
    req_ids: list[str],
    token_ids: list[int],
    drafts: dict[str, Sequence[int]],
    errors: dict[str, str],
    columns: Sequence[list[Any] | None] = (),
) -> tuple[list[str], list[int], list[list[Any] | None], dict[str, int]]:
    """The rows kept of a step's sampled rows (a request with drafts has its rows one after
    another), with the same rows of each list in `columns` (logprobs, ranks, top logprobs), and
    the number of drafts kept per request with drafts. A request in `errors` keeps no row."""
    keep: list[int] = []
    accepted: dict[str, int] = {}
    row, n = 0, len(req_ids)
    while row < n:
        rid = req_ids[row]
        end = row + 1
        while end < n and req_ids[end] == rid:
            end += 1
        if rid in errors:
            row = end
            continue
        draft = drafts.get(rid)
        if draft is None:
            keep.extend(range(row, end))
            row = end
            continue
        taken = 0
        while taken < len(draft) and row + taken + 1 < end and token_ids[row + taken] == draft[taken]:
            taken += 1
        keep.extend(range(row, row + taken + 1))
        accepted[rid] = taken
        row = end
    if len(keep) == n:
        return req_ids, token_ids, list(columns), accepted
    picked = [None if c is None else [c[i] for i in keep] for c in columns]
    return [req_ids[i] for i in keep], [token_ids[i] for i in keep], picked, accepted


def rewind_generators(states: dict[str, tuple[torch.Generator, torch.Tensor]], accepted: dict[str, int]) -> None:
    """Set each seeded generator back to its state before the step, then draw one uniform per row
    kept (sampler.uniforms draws one float64 per drawn row, serially): the next step draws what a
    step without drafts would. `states`: request -> (its generator, the state before the step)."""
    import torch

    for rid, (gen, state) in states.items():
        gen.set_state(state)
        torch.rand(accepted.get(rid, 0) + 1, generator=gen, dtype=torch.float64)
