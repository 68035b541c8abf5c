"""The host's half of a recurrent model's replayed mixed step (model/static_scan.py): each request's
block-aligned segments - their token rows, the blocks their final states go to, their order as a
chain - and the conv's input windows, as row indices into the step's rows and each request's conv
state before its chunk, padded to the fixed buffers' shapes.

A request may continue from a block that an earlier request of the same step writes (a prefix hit on
a block computed in this step, as when prompts sharing a prefix arrive together). Its chain then
first walks the writer's chain up to that block's segment, from the writer's initial state, before
its own segments - the shared segments computed twice, by the same operations on the same values,
so both programs write the same bits - and its conv reads that segment's last inputs where it
would read its state's columns: the eager plan's order, without an order across programs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .scheduler_output import ScheduledRequest


@dataclass
class ScanHostInputs:
    """int64 unless said: `states` [2, max_seqs + 1] (block to continue from, 1 where there is
    one), `pad_index` [segments, block_size], `seg_blocks` [segments], `out_index` [size],
    `chains` int32 [requests, longest chain] (the buffer's other entries are never read: their
    chain lengths are 0, or shorter), `chain_len` int32 [max_seqs + 1], `conv_rows` [size, K],
    `conv_ends` [segments, K - 1]."""

    states: torch.Tensor
    pad_index: torch.Tensor
    seg_blocks: torch.Tensor
    out_index: torch.Tensor
    chains: torch.Tensor
    chain_len: torch.Tensor
    conv_rows: torch.Tensor
    conv_ends: torch.Tensor


def build_scan(
    scheduled: Sequence[ScheduledRequest],
    query_start_loc: Sequence[int],
    size: int,
    segments: int,
    max_seqs: int,
    block_size: int,
    conv_kernel: int,
    null_block: int,
) -> ScanHostInputs:
    """The plan of a step of `scheduled` (rows from `query_start_loc`) padded to `size` rows and
    `segments` segments: padding segments take the zero row (`size`) and write the null block,
    padding rows' windows read the zero row of the conv table (after the step's rows and each
    request's K - 1 state columns). In NumPy, row by row and segment by segment at once: a step of
    hundreds of requests builds in well under a millisecond."""
    bs, K = block_size, conv_kernel
    n = len(scheduled)
    zero_row = size + (max_seqs + 1) * (K - 1)
    lens = np.fromiter((len(sr.token_ids) for sr in scheduled), dtype=np.int64, count=n)
    starts = np.fromiter((sr.start for sr in scheduled), dtype=np.int64, count=n)
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    total = int(qsl[n])
    ends = starts + lens
    # each request's blocks from the one holding position start - 1 (or start) to its last
    first = np.maximum(starts - 1, 0) // bs
    last = (ends - 1) // bs
    width = int((last - first).max()) + 1
    span = np.zeros((n, width), dtype=np.int64)
    for r, sr in enumerate(scheduled):
        piece = sr.block_table[first[r] : last[r] + 1]
        span[r, : len(piece)] = piece

    states = np.zeros((2, max_seqs + 1), dtype=np.int64)
    has_prev = starts > 0
    states[0, :n] = np.where(has_prev, span[:, 0], 0)
    states[1, :n] = has_prev

    # segments: a request's blocks from start's to its last, numbered in request order
    seg_first = starts // bs
    counts = last - seg_first + 1
    seg0 = np.cumsum(counts) - counts
    used = int(counts.sum())
    seg_req = np.repeat(np.arange(n), counts)
    seg_block_no = np.arange(used) - np.repeat(seg0, counts) + np.repeat(seg_first, counts)
    seg_blocks = np.full(segments, null_block, dtype=np.int64)
    seg_blocks[:used] = span[seg_req, seg_block_no - first[seg_req]]
    # as long as the longest chain may grow by continuing another's (its segments and that prefix)
    chains = np.zeros((n, used), dtype=np.int32)
    chains[seg_req, np.arange(used) - seg0[seg_req]] = np.arange(used)
    chain_len = np.zeros(max_seqs + 1, dtype=np.int32)
    chain_len[:n] = counts

    def source(req: np.ndarray, local: np.ndarray) -> np.ndarray:
        """The conv table's row of request `req`'s input at local position `local` (negative: its
        state's columns)."""
        rows: np.ndarray = np.where(local >= 0, qsl[req] + local, size + req * (K - 1) + (K - 1) + local)
        return rows

    # rows: each real row's request, local position, segment and slot in it
    row_req = np.repeat(np.arange(n), lens)
    local = np.arange(total) - qsl[row_req]
    pos = starts[row_req] + local
    row_seg = seg0[row_req] + pos // bs - seg_first[row_req]
    row_slot = pos - np.maximum(starts[row_req], (pos // bs) * bs)
    pad_index = np.full((segments, bs), size, dtype=np.int64)
    pad_index[row_seg, row_slot] = np.arange(total)
    out_index = np.zeros(size, dtype=np.int64)
    out_index[:total] = row_seg * bs + row_slot
    conv_rows = np.full((size, K), zero_row, dtype=np.int64)
    conv_rows[:total] = source(row_req[:, None], local[:, None] - (K - 1) + np.arange(K))
    # each segment's local end, and its last K - 1 inputs
    seg_end = np.minimum(ends[seg_req], (seg_block_no + 1) * bs) - starts[seg_req]
    conv_ends = np.full((segments, K - 1), zero_row, dtype=np.int64)
    conv_ends[:used] = source(seg_req[:, None], seg_end[:, None] - (K - 1) + np.arange(K - 1))
    # block-aligned continuations from a block some segment of the step writes: prefix hits inside
    # the step (a decode or chunk inside a block reads the block it writes itself)
    candidates = np.flatnonzero(has_prev & (starts % bs == 0) & np.isin(states[0, :n], seg_blocks[:used]))
    if candidates.size:
        _continue_writers(
            candidates, states, seg_blocks[:used], seg0, counts, seg_req, qsl, chains, chain_len, conv_rows,
            conv_ends, size, K,
        )  # fmt: skip
    chains = np.ascontiguousarray(chains[:, : max(int(chain_len[:n].max()), 1)])
    return ScanHostInputs(
        *(
            torch.from_numpy(a)
            for a in (states, pad_index, seg_blocks, out_index, chains, chain_len, conv_rows, conv_ends)
        )
    )


def _continue_writers(
    candidates: np.ndarray,
    states: np.ndarray,
    seg_blocks: np.ndarray,
    seg0: np.ndarray,
    counts: np.ndarray,
    seg_req: np.ndarray,
    qsl: np.ndarray,
    chains: np.ndarray,
    chain_len: np.ndarray,
    conv_rows: np.ndarray,
    conv_ends: np.ndarray,
    size: int,
    K: int,
) -> None:
    """Each candidate request (in step order) that continues from a block an earlier request of the
    step writes: its chain that request's up to the writing segment, then its own; its initial
    state the writer's; its conv's inputs before its chunk the writing segment's last K - 1 (their
    own fixed already where the writer itself continued another) in place of its state columns."""
    for r in candidates.tolist():
        hits = np.flatnonzero(seg_blocks[: seg0[r]] == states[0, r])
        if not hits.size:
            continue  # the block is written later in the step, by r itself or after it
        s = int(hits[-1])
        a = int(seg_req[s])
        prefix = chains[a, : chain_len[a]]
        k = int(np.flatnonzero(prefix == s)[0]) + 1
        own = chains[r, : counts[r]].copy()
        chains[r, :k] = prefix[:k]
        chains[r, k : k + own.size] = own
        chain_len[r] = k + own.size
        states[:, r] = states[:, a]
        lo = size + r * (K - 1)
        for view in (conv_rows[qsl[r] : qsl[r + 1]], conv_ends[seg0[r] : seg0[r] + counts[r]]):
            mine = (view >= lo) & (view < lo + K - 1)
            view[mine] = conv_ends[s][view[mine] - lo]
