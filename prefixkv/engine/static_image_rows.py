"""A mixed step's image embeddings over fixed buffers: what a CUDA graph of a vision-language
model's mixed step reads in place of the eager step's splice.

An eager step looks up its tokens' embeddings and overwrites the rows of image placeholders with
the encoder's output (multimodal/embedding.py). A captured step cannot take a tensor made per step,
so the encoder's rows are copied into a buffer of the graph's width beside a mask of the rows they
replace, and the graph selects between the buffer and the looked-up embeddings row by row: the same
values as the eager splice (a select copies, it rounds nothing), the encoder itself still run
outside the graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class StaticImageRows:
    """`max_tokens` rows of `hidden` input embeddings (the model's dtype) and which of them a step
    takes from here rather than from the token embedding."""

    def __init__(self, max_tokens: int, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        self.rows = torch.zeros(max_tokens, hidden, dtype=dtype, device=device)
        self.mask = torch.zeros(max_tokens, 1, dtype=torch.bool, device=device)
        self._masked = False  # whether the mask holds a row from the last step with images
        self.steps = 0  # steps that spliced image rows through here (a test checks the path ran)

    def fill(self, spliced: Sequence[tuple[int, torch.Tensor]]) -> None:
        """A step's image rows: (its first row in the step, the encoder's rows for it). Every other
        row takes its token's embedding. The copies go in stream order (the host does not wait)."""
        if self._masked:
            self.mask.zero_()
        for row, values in spliced:
            end = row + values.shape[0]
            self.rows[row:end].copy_(values, non_blocking=True)  # cast as the eager splice casts
            self.mask[row:end] = True
        self._masked = bool(spliced)
        self.steps += bool(spliced)

    def embeds(self, embed: Callable[[torch.Tensor], torch.Tensor], input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of a step of len(input_ids) rows: what a graph records."""
        size = input_ids.shape[0]
        return torch.where(self.mask[:size], self.rows[:size], embed(input_ids))
