"""A step's constraints applied to its logits where they lie, a GPU: every row's allowed tokens
as one bitmask and its logit_bias as one list, filled on the host and copied over in stream order,
so that the host never waits for the step's logits (as editing rows on the host would) and a step
scheduled ahead samples without that wait.

Bit-equal to `RequestConstraints.apply` row by row: the same bias additions, then -inf wherever
`apply` sets it. A row with nothing allowed is refused from its bitmask alone, as `sample` refuses
it on the host (the logits are finite: the runner fails rows that are not before sampling).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..model.host_copy import tensor_on, to_device
from .grammar import fill_next
from .token_constraints import clear_bits, grammar_rows

if TYPE_CHECKING:
    from .token_constraints import RequestConstraints

NOTHING_ALLOWED = (
    "no token is allowed by this request's constraints (allowed_token_ids, bad_words, logit_bias, structured "
    "outputs, min_tokens)"
)


@dataclass
class StepMasks:
    """A step's constraints ready to apply: the constrained rows, their allowed tokens as bits
    (int32 [rows, words], on the host) and the logit_bias additions as flat indices into the
    batch's logits with their values (None: no bias)."""

    rows: list[int]
    bits: torch.Tensor
    bias: tuple[torch.Tensor, torch.Tensor] | None

    def apply(self, x: torch.Tensor, masked: float = float("-inf")) -> None:
        """Constrain the rows of `x` [N, vocab] (contiguous float32) in place, each token they
        rule out set to `masked`; the bits and biases copied to x's device in stream order."""
        if not self.rows:
            return
        vocab = x.shape[1]
        dev = x.device
        if self.bias is not None:
            x.view(-1).index_add_(0, to_device(self.bias[0], dev), to_device(self.bias[1], dev))
        shifts = torch.arange(32, dtype=torch.int32, device=dev)
        ruled_out = ((to_device(self.bits, dev)[:, :, None] >> shifts) & 1).view(len(self.rows), -1)[:, :vocab] == 0
        if len(self.rows) == x.shape[0]:
            x.masked_fill_(ruled_out, masked)
        else:
            at = tensor_on(self.rows, dev, torch.long)
            x[at] = x[at].masked_fill(ruled_out, masked)


def step_masks(
    num_rows: int,
    vocab: int,
    constraints: list[RequestConstraints | None] | None,
    output_ids: list[list[int]],
    eos_ids: list[set[int] | None] | None,
) -> StepMasks:
    """The masks of a step's rows that have constraints or blocked EOS ids (min_tokens not
    reached), built on the host. ValueError when a row allows no token."""
    rows = [r for r in range(num_rows) if (constraints and constraints[r] is not None) or (eos_ids and eos_ids[r])]
    row_constraints = [constraints[r] if constraints else None for r in rows]
    bits = torch.empty((len(rows), (vocab + 31) // 32), dtype=torch.int32)
    # the grammars' masks first, in one batch call; every other row starts with all allowed
    with_grammar, grammars, pending = grammar_rows(row_constraints, [output_ids[r] for r in rows])
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
    return StepMasks(rows, bits, (torch.cat(bias_at), torch.cat(bias_values)) if bias_at else None)


def apply_on_device(
    x: torch.Tensor,
    constraints: list[RequestConstraints | None] | None,
    output_ids: list[list[int]],
    eos_ids: list[set[int] | None] | None,
    masked: float = float("-inf"),
) -> None:
    """Constrain, in place, the rows of `x` [N, vocab] (contiguous float32) that have constraints
    or blocked EOS ids, each token they rule out set to `masked`. ValueError when a row allows no
    token, before anything is edited."""
    step_masks(x.shape[0], x.shape[1], constraints, output_ids, eos_ids).apply(x, masked)
