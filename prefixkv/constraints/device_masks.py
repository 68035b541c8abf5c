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
from .token_constraints import clear_bits

if TYPE_CHECKING:
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
) -> None:
    """Constrain, in place, the rows of `x` [N, vocab] (contiguous float32) that have constraints
    or blocked EOS ids (min_tokens not reached). ValueError when a row allows no token."""
    n, vocab = x.shape
    rows = [r for r in range(n) if (constraints and constraints[r] is not None) or (eos_ids and eos_ids[r])]
    bits = torch.empty((len(rows), (vocab + 31) // 32), dtype=torch.int32)
    bias_at: list[torch.Tensor] = []
    bias_values: list[torch.Tensor] = []
    for i, r in enumerate(rows):
        c = constraints[r] if constraints else None
        if c is None:
            bits[i].fill_(-1)
        else:
            c.allowed_into(bits[i : i + 1], output_ids[r])
        blocked = eos_ids[r] if eos_ids else None
        if blocked:
            clear_bits(bits[i], sorted(blocked))
        if c is not None and c.bias_ids is not None:
            bias_at.append(c.bias_ids + r * vocab)
            bias_values.append(c.bias_values)  # type: ignore[arg-type]
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
        x.masked_fill_(blocked_tokens, float("-inf"))
    else:
        at = tensor_on(rows, dev, torch.long)
        x[at] = x[at].masked_fill(blocked_tokens, float("-inf"))
