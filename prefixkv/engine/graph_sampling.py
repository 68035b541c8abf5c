"""A sampled decode step's draws, replayed as CUDA graphs after the decode graph whose logits they
read (cuda_graphs.DecodeTail): sampling's few dozen small operators - temperature, top-k, min-p,
top-p, the inverse-CDF draw - are each a launch from the host a step, beside a forward that is one.

Each row's parameters and uniform are written on the host into a page-locked buffer and copied in
one copy (sampler.fixed_params: the uniforms drawn from the requests' own generators, as the eager
sampler draws them); the graph computes `sampler.draw_fixed` over the shared logits buffer into
a buffer of tokens. Per decode size two graphs: one without the sort that top-k and top-p need
(temperature, min-p, greedy rows), one with it; and a third replayed after either where a row asks
for logprobs (`sampler.score_rows`: each drawn token's logprob and rank, and every row's top
TOP_LOGPROBS, each row's list cut to its own count on the host). Penalized and constrained rows
are drawn here too, their logits edited in place first (penalties, then `RULED_OUT` where the
constraints rule a token out: ModelRunner._edit_for_graph); where a row asks for logprobs, the raw
rows are kept in `raw` before the edit and put back before the scores, which are the raw logits'
as the eager sampler's are. Rows with more logprobs than that sample eagerly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from ..sampling_params import SamplingParams
from .sampler import SAMPLE_PARAMS, draw_fixed, fixed_params, score_rows, top_logprobs_k

# What a token that constraints rule out holds in the logits a draws' graph reads (the runner
# edits them in place: ModelRunner._edit_for_graph). Finite, so `draw_fixed`'s check of the
# row passes (-inf would fail it: the row drawn from zeros), and far below any logit: exp() of it
# is 0 as of -inf, so the draws are `sample`'s over -inf, token for token (tests/engine/test_sampler.py).
RULED_OUT = -1e30

# a padding row's parameters, a column: greedy, nothing filtered (its draw is well-defined and unused)
_PADDING = np.array([0.0, 1.0, -math.inf, 0.0, 1.0, 1.0])[:, None]


class GraphSampling:
    """The buffers of the draws of up to `rows` rows over a vocabulary of `vocab` tokens and of
    their scores, and their graphs (one per (sorted, size) and a scores graph per size, filled by
    StepGraphs.capture)."""

    def __init__(self, rows: int, vocab: int, device: torch.device, pinned: bool) -> None:
        self.vocab = vocab
        self.params = torch.zeros(SAMPLE_PARAMS, rows, dtype=torch.float64, device=device)
        self.host = torch.zeros(SAMPLE_PARAMS, rows, dtype=torch.float64, pin_memory=pinned)
        self._host_rows = self.host.numpy()
        self.drawn = torch.zeros(2, rows, dtype=torch.long, device=device)  # the tokens, and marked
        self.graphs: dict[tuple[bool, int], torch.cuda.CUDAGraph] = {}
        # the drawn tokens' logprobs and ranks, and each row's top logprobs (values, indices)
        self.top_k = top_logprobs_k(vocab)
        self.chosen = torch.zeros(rows, dtype=torch.float32, device=device)
        self.ranks = torch.zeros(rows, dtype=torch.long, device=device)
        self.top_values = torch.zeros(rows, self.top_k, dtype=torch.float32, device=device)
        self.top_ids = torch.zeros(rows, self.top_k, dtype=torch.long, device=device)
        self.score_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # the raw logits of edited rows whose scores are asked (keep_raw), put back before scoring
        self.raw = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
        # the page-locked parameters are rewritten only once the last copy from them is done
        self._copied: torch.cuda.Event | None = torch.cuda.Event() if pinned else None  # type: ignore[no-untyped-call]

    def takes(self, params: Sequence[SamplingParams]) -> bool:
        """Whether these rows' tokens are drawn here: no more logprobs than the graphs score (the
        caller edits the logits for penalties and constraints first, or draws eagerly)."""
        top_k = self.top_k
        return all(p.logprobs is None or p.logprobs <= top_k for p in params)

    def fill(self, params: list[SamplingParams], generators: list[torch.Generator], size: int) -> bool:
        """The rows' parameters for a step of `size` rows, copied to the device in stream order;
        returns whether the step takes the sorted variant."""
        if self._copied is not None:
            self._copied.synchronize()  # (at once where never recorded)
        n = len(params)
        sort = fixed_params(params, self.vocab, generators, self._host_rows)
        if size > n:
            self._host_rows[:, n:size] = _PADDING
        # the whole buffer: one contiguous copy (a few KiB), where a size's columns are strided
        self.params.copy_(self.host, non_blocking=True)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.params.device))
        return sort

    def record(self, logits: torch.Tensor, sort: bool) -> None:
        """What a graph records: the draws of `logits`' rows (the first rows of the shared logits
        buffer) into `drawn`."""
        size = logits.shape[0]
        tokens, marked = draw_fixed(logits, self.params[:, :size], sort)
        self.drawn[0, :size].copy_(tokens)
        self.drawn[1, :size].copy_(marked)

    def record_scores(self, logits: torch.Tensor) -> None:
        """What a scores graph records: `score_rows` of `logits`' rows and the tokens drawn for
        them (`drawn`) into the scores' buffers."""
        size = logits.shape[0]
        chosen, ranks, values, ids = score_rows(logits, self.drawn[0, :size], self.top_k)
        self.chosen[:size].copy_(chosen)
        self.ranks[:size].copy_(ranks)
        self.top_values[:size].copy_(values)
        self.top_ids[:size].copy_(ids)

    def keep_raw(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of `logits` (the first rows of the shared buffer, about to be edited in place for
        the draws) in `raw`, for `scores` to read the raw logits: one copy on the device."""
        raw = self.raw[: logits.shape[0]]
        raw.copy_(logits)
        return raw

    def scores(
        self, logits: torch.Tensor, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The logprobs and ranks of `tokens` (what `replay` drew from `logits`) and the rows' top
        logprobs (values, indices): the scores graph of `logits`' size replayed into the buffers
        (rewritten by the next), or where none was captured computed anew."""
        size = logits.shape[0]
        graph = self.score_graphs.get(size)
        if graph is None:
            return score_rows(logits, tokens, self.top_k)
        graph.replay()
        return self.chosen[:size], self.ranks[:size], self.top_values[:size], self.top_ids[:size]

    def replay(self, logits: torch.Tensor, sort: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The draws of `logits`' rows and their marked tokens: the graph of their size and variant
        replayed into `drawn` (rewritten by the next), or where none was captured computed anew."""
        size = logits.shape[0]
        graph = self.graphs.get((sort, size))
        if graph is None:
            return draw_fixed(logits, self.params[:, :size], sort)
        graph.replay()
        return self.drawn[0, :size], self.drawn[1, :size]
