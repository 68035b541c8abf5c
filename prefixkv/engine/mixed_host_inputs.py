"""The host's half of a replayed mixed step (cuda_graphs.py, model/static_mixed.py): each row's input
id, position and slot, each sequence's first row, new tokens, length and block table, and the tile
map that tells the attention kernel's fixed grid which sequence and tile each program takes.

A mixed step comes once in a while (a prompt joins running decodes), so its inputs are built afresh
from the scheduled requests, in NumPy, without the decode path's block-table mirror, then laid out
as the device's buffers (MixedHostBuffer, model/static_mixed.MixedLayout): one copy to the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..model.static_mixed import MixedLayout
from .scheduler_output import ScheduledRequest


@dataclass
class MixedStepInputs:
    """One step's host tensors: `tokens` int64 [3, size] (ids, positions, slots; padding rows
    token 0 at position 0 in the null slot), `seqs` int32 [3, C] (first row, new tokens, length),
    `tables` int32 [C, width], `tile_map` int32 [2, tiles] (the rest naming the padding sequence),
    `query_start_loc` (each request's first row, and the end), and per later KV-cache group its
    rows' slots int64 [size] and its tables int32 [C, width]."""

    tokens: torch.Tensor
    seqs: torch.Tensor
    tables: torch.Tensor
    tile_map: torch.Tensor
    query_start_loc: list[int]
    groups: list[tuple[torch.Tensor, torch.Tensor]]


def tile_map(q_lens: Sequence[int] | np.ndarray, tile_tokens: int, tiles: int, padding_seq: int) -> np.ndarray:
    """Column i: the sequence and the tile of it program i takes - sequence c's ceil(q_lens[c] /
    tile_tokens) tiles in order, then `padding_seq` (no tokens: its programs do nothing)."""
    lens = np.asarray(q_lens, dtype=np.int64)
    counts = -(-lens // tile_tokens)
    used = int(counts.sum())
    if used > tiles:
        raise ValueError(f"{used} tiles of {tile_tokens} tokens do not fit a map of {tiles}")
    out = np.zeros((2, tiles), dtype=np.int32)
    out[0] = padding_seq
    out[0, :used] = np.repeat(np.arange(len(lens), dtype=np.int32), counts)
    firsts = np.cumsum(counts) - counts  # each sequence's first column
    out[1, :used] = np.arange(used) - np.repeat(firsts, counts)
    return out


def build_mixed(
    scheduled: Sequence[ScheduledRequest],
    size: int,
    tiles: int,
    tile_tokens: int,
    padding_seq: int,
    block_size: int,
    null_slot: int,
    max_blocks: int,
    group_tables: Sequence[Sequence[list[int]]] = (),
) -> MixedStepInputs:
    """The host tensors of a step of `scheduled` (their new tokens at most `size`) padded to `size`
    rows, each block table cut to `max_blocks` (the buffers' width; blocks past it hold no position
    of the step). `group_tables`: per later KV-cache group, each request's table in it. Raises
    where a position lies past its request's table (the scheduler gives every token a slot)."""
    n = len(scheduled)
    lens = np.fromiter((len(sr.token_ids) for sr in scheduled), dtype=np.int64, count=n)
    starts = np.fromiter((sr.start for sr in scheduled), dtype=np.int64, count=n)
    qsl = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=qsl[1:])
    total = int(qsl[-1])
    if total > size:
        raise ValueError(f"a step of {total} tokens does not fit {size} rows")
    ends = starts + lens
    row_seq = np.repeat(np.arange(n), lens)  # each real row's request
    positions = np.arange(total) - np.repeat(qsl[:-1], lens) + np.repeat(starts, lens)

    def slots_and_tables(block_tables: Sequence[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Each row's slot [size] (padding rows the null slot) and the tables [n, width]."""
        widths = [min(len(table), max_blocks) for table in block_tables]
        tables = np.zeros((n, max(widths, default=0)), dtype=np.int32)
        for i, table in enumerate(block_tables):
            w = widths[i]
            tables[i, :w] = table if w == len(table) else table[:w]
        short = np.flatnonzero(-(-ends // block_size) > np.asarray(widths, dtype=np.int64))
        if short.size:
            i = int(short[0])
            raise IndexError(
                f"request {scheduled[i].req_id}: position {int(ends[i]) - 1} lies past its {widths[i]} blocks"
            )
        slots = np.full(size, null_slot, dtype=np.int64)
        slots[:total] = tables[row_seq, positions // block_size].astype(np.int64) * block_size + positions % block_size
        return slots, tables

    slots, tables = slots_and_tables([sr.block_table for sr in scheduled])
    tokens = np.zeros((3, size), dtype=np.int64)
    tokens[0, :total] = [t for sr in scheduled for t in sr.token_ids]
    tokens[1, :total] = positions
    tokens[2] = slots
    seqs = np.stack([qsl[:-1], lens, ends]).astype(np.int32)
    groups = []
    for g in group_tables:
        g_slots, g_tables = slots_and_tables(g)
        groups.append((torch.from_numpy(g_slots), torch.from_numpy(g_tables)))
    return MixedStepInputs(
        torch.from_numpy(tokens),
        torch.from_numpy(seqs),
        torch.from_numpy(tables),
        torch.from_numpy(tile_map(lens, tile_tokens, tiles, padding_seq)),
        qsl.tolist(),
        groups,
    )


class MixedHostBuffer:
    """A mixed step's inputs laid out as the device's (MixedLayout) in one flat int32 buffer,
    page-locked where `pinned` (the caller makes sure a copy from it is done before the next `fill`
    rewrites it)."""

    def __init__(self, layout: MixedLayout, pinned: bool = False) -> None:
        self.layout = layout
        self.flat = torch.zeros(layout.length, dtype=torch.int32, pin_memory=pinned)
        # per size: its tokens, sequences, tile map and tables as NumPy arrays (the same memory)
        self._views: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}

    def fill(self, step: MixedStepInputs, size: int) -> tuple[int, int]:
        """Write a step of `size` rows in (NumPy: host memory, no operator); returns the span of
        the flat buffer it occupies (MixedLayout.span). Sequences past the step's are zeros: no
        tokens (the padding one's)."""
        views = self._views.get(size)
        if views is None:
            tokens_t, seqs_t, tile_map_t, tables_t = self.layout.views(self.flat, size)
            views = self._views[size] = (tokens_t.numpy(), seqs_t.numpy(), tile_map_t.numpy(), tables_t.numpy())
        tokens, seqs, tile_map, tables = views
        n, width = step.tables.shape
        tokens[:] = step.tokens.numpy()
        seqs[:] = 0
        seqs[:, :n] = step.seqs.numpy()
        tile_map[:] = step.tile_map.numpy()
        tables[:n, :width] = step.tables.numpy()
        return self.layout.span(size, n)
