"""The host's half of a recurrent model's replayed mixed step (model/static_scan.py): each request's
block-aligned segments - their token rows, the blocks their final states go to, their order as a
chain - and the conv's input windows, as row indices into the step's rows and each request's conv
state before its chunk, padded to the fixed buffers' shapes.

A step where a request continues from a block another request of the same step writes (a prefix hit
on a block computed in this step) needs the segments in dependency order across requests, which the
chains do not give: `reads_a_block_written_here` says so, and that step runs eagerly.
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
    `chains` int32 [max_seqs + 1, max_chain], `chain_len` int32 [max_seqs + 1], `conv_rows`
    [size, K], `conv_ends` [segments, K - 1]."""

    states: torch.Tensor
    pad_index: torch.Tensor
    seg_blocks: torch.Tensor
    out_index: torch.Tensor
    chains: torch.Tensor
    chain_len: torch.Tensor
    conv_rows: torch.Tensor
    conv_ends: torch.Tensor


def reads_a_block_written_here(scheduled: Sequence[ScheduledRequest], block_size: int) -> bool:
    """Whether a request continues from a block that an earlier request of the step writes."""
    written: set[int] = set()
    for sr in scheduled:
        start, table = sr.start, sr.block_table
        if start and table[(start - 1) // block_size] in written:
            return True
        end = start + len(sr.token_ids)
        written.update(table[start // block_size : (end - 1) // block_size + 1])
    return False


def build_scan(
    scheduled: Sequence[ScheduledRequest],
    query_start_loc: Sequence[int],
    size: int,
    segments: int,
    max_seqs: int,
    max_chain: int,
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
    chains = np.zeros((max_seqs + 1, max_chain), dtype=np.int32)
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
    return ScanHostInputs(
        *(
            torch.from_numpy(a)
            for a in (states, pad_index, seg_blocks, out_index, chains, chain_len, conv_rows, conv_ends)
        )
    )
