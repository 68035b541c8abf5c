"""A step's constraints applied to its logits where they lie, a GPU: every row's allowed tokens
as one bitmask and its logit_bias as one list, filled on the host and copied over in stream order,
so that the host never waits for the step's logits (as editing rows on the host would) and a step
scheduled ahead samples without that wait.

Bit-equal to `RequestConstraints.apply` row by row: the same bias additions, then -inf wherever
`apply` sets it. A row with nothing allowed is refused from its bitmask alone, as `sample` refuses
it on the host (the logits are finite: the runner fails rows that are not before sampling).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..model.host_copy import tensor_on, to_device
from .grammar import fill_next
from .token_constraints import clear_bits

if TYPE_CHECKING:
    from .grammar import RequestGrammar
    from .token_constraints import RequestConstraints

NOTHING_ALLOWED = (
    "no token is allowed by this request's constraints (allowed_token_ids, bad_words, logit_bias, structured "
    "outputs, min_tokens)"
)


def apply_on_device(
    x: torch.Tensor,
    constraints: list[RequestConstraints | None] | None,
    output_ids: list[list[int]],
    eos_ids: list[set[int] | None] | None,
    masked: float = float("-inf"),
) -> None:
    """Constrain, in place, the rows of `x` [N, vocab] (contiguous float32) that have constraints
    or blocked EOS ids (min_tokens not reached), each token they rule out set to `masked`.
    ValueError when a row allows no token, before anything is edited."""
    n, vocab = x.shape
    rows = [r for r in range(n) if (constraints and constraints[r] is not None) or (eos_ids and eos_ids[r])]
    row_constraints = [constraints[r] if constraints else None for r in rows]
    bits = torch.empty((len(rows), (vocab + 31) // 32), dtype=torch.int32)
    # the grammars' masks first, in one batch call; every other row starts with all allowed
    with_grammar: list[int] = []
    grammars: list[RequestGrammar] = []
    pending: list[list[int]] = []
    for i, c in enumerate(row_constraints):
        if c is not None and c.grammar is not None:
            with_grammar.append(i)
            grammars.append(c.grammar)
            pending.append(c.pending(output_ids[rows[i]]))
    filled = fill_next(grammars, pending, bits, with_grammar)
    unfilled = set(range(len(rows))).difference(i for i, ok in zip(with_grammar, filled) if ok)
    bias_at: list[torch.Tensor] = []
    bias_values: list[torch.Tensor] = []
    for i, (r, c) in enumerate(zip(rows, row_constraints)):
        if i in unfilled:
            bits[i].fill_(-1)
        if c is not None:
            c.narrow(bits[i], output_ids[r])
        blocked = eos_ids[r] if eos_ids else None
        if blocked:
            clear_bits(bits[i], sorted(blocked))
        if c is not None and c.bias_ids is not None and c.bias_values is not None:
            bias_at.append(c.bias_ids + r * vocab)
            bias_values.append(c.bias_values)
    words = bits.numpy().view(np.uint32)
    if vocab % 32:  # bits past the vocabulary mean nothing
        words[:, -1] &= np.uint32((1 << (vocab % 32)) - 1)
    if not words.any(axis=1).all():
        raise ValueError(NOTHING_ALLOWED)
    dev = x.device
    if bias_at:
        x.view(-1).index_add_(0, to_device(torch.cat(bias_at), dev), to_device(torch.cat(bias_values), dev))
    shifts = torch.arange(32, dtype=torch.int32, device=dev)
    blocked_tokens = ((to_device(bits, dev)[:, :, None] >> shifts) & 1).view(len(rows), -1)[:, :vocab] == 0
    if len(rows) == n:
        x.masked_fill_(blocked_tokens, masked)
    else:
        at = tensor_on(rows, dev, torch.long)
        x[at] = x[at].masked_fill(blocked_tokens, masked)
