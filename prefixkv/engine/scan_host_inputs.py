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
from numpy.lib.stride_tricks import sliding_window_view

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
    request's K - 1 state columns)."""
    bs, K = block_size, conv_kernel
    zero_row = size + (max_seqs + 1) * (K - 1)
    states = np.zeros((2, max_seqs + 1), dtype=np.int64)
    pad_index = np.full((segments, bs), size, dtype=np.int64)
    seg_blocks = np.full(segments, null_block, dtype=np.int64)
    out_index = np.zeros(size, dtype=np.int64)
    chains = np.zeros((max_seqs + 1, max_chain), dtype=np.int32)
    chain_len = np.zeros(max_seqs + 1, dtype=np.int32)
    conv_rows = np.full((size, K), zero_row, dtype=np.int64)
    conv_ends = np.full((segments, K - 1), zero_row, dtype=np.int64)
    s = 0
    for r, sr in enumerate(scheduled):
        start, table, q0 = sr.start, sr.block_table, query_start_loc[r]
        n = len(sr.token_ids)
        end = start + n
        if start:
            states[0, r], states[1, r] = table[(start - 1) // bs], 1
        # the conv's sources by local position - (K - 1): the state's K - 1 columns, then the rows
        src = np.concatenate([size + r * (K - 1) + np.arange(K - 1), q0 + np.arange(n)])
        conv_rows[q0 : q0 + n] = sliding_window_view(src, K)
        k, pos = 0, start
        while pos < end:
            seg_end = min(end, (pos // bs + 1) * bs)
            m, local = seg_end - pos, pos - start
            pad_index[s, :m] = q0 + local + np.arange(m)
            out_index[q0 + local : q0 + local + m] = s * bs + np.arange(m)
            seg_blocks[s] = table[pos // bs]
            chains[r, k] = s
            conv_ends[s] = src[seg_end - start : seg_end - start + K - 1]
            s, k, pos = s + 1, k + 1, seg_end
        chain_len[r] = k
    return ScanHostInputs(
        *(
            torch.from_numpy(a)
            for a in (states, pad_index, seg_blocks, out_index, chains, chain_len, conv_rows, conv_ends)
        )
    )
