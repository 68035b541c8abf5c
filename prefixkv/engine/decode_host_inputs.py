"""The host's half of a replayed decode step (cuda_graphs.py): each row's input id, position,
slot and length, and the block tables, built in NumPy from a block-table mirror that lives from step
to step, in one flat buffer laid out as the device's (model/static_decode.DecodeLayout): a step's
inputs go to the device in one copy from memory kept from step to step.

A decoding request keeps its block table for `block_size` steps: the scheduler hands the same list
on until a block is added (Scheduler.schedule_ahead), so a row is rewritten only when its list is a
new one - at batch 256 about one row in sixteen a step, where building every row's table took most
of the step's input work. Slots and lengths then come out of the mirror in a few vectorized
operations instead of a Python expression per request.

For a recurrent model (`recurrent`) each row also names the block holding the state it continues
from (that of position - 1; any block at position 0, where the device reads none) and the block
its new state goes to (its slot's; the null block for padding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..model.static_decode import DecodeLayout
from .scheduler_output import ScheduledRequest


@dataclass(slots=True)
class HostDecodeStep:
    """A step's host inputs, views of DecodeHostInputs.flat: `rows` [3 or 5, size] int64, `lens`
    [size] int32, `tables` [requests, width] int32 (NumPy; row stride: the buffers' width), and
    `span`, the flat entries the step reads (DecodeLayout.span)."""

    rows: torch.Tensor
    lens: torch.Tensor
    tables: np.ndarray
    span: tuple[int, int]


class DecodeHostInputs:
    """A replayed decode step's inputs, written into one flat int32 buffer laid out by DecodeLayout
    (page-locked where `pinned`: copied from in stream order, kept from step to step), whose block
    tables are the mirror: row i holds the table last written there. `build` fills a step's header
    and the rows whose table changed."""

    def __init__(
        self,
        max_batch: int,
        max_blocks: int,
        block_size: int,
        null_slot: int,
        recurrent: bool = False,
        pinned: bool = False,
    ) -> None:
        """`pinned`: page-locked memory (a GPU's copies read it without staging; the caller makes
        sure a copy from it has been done before the next `build` rewrites it)."""
        self.block_size, self.null_slot = block_size, null_slot
        self.recurrent = recurrent
        self.layout = DecodeLayout(max_batch, max_blocks, recurrent)
        self.flat = torch.zeros(self.layout.length, dtype=torch.int32, pin_memory=pinned)
        flat_np = self.flat.numpy()
        at = self.layout.tables_at
        self.tables = flat_np[at:].reshape(max_batch, max_blocks)  # the mirror, in place
        self.num_blocks = np.zeros(max_batch, dtype=np.int64)  # how much of each row is its table
        self._flat_tables = flat_np[at:]  # the same memory, indexed by row start + block
        self._row_starts = np.arange(max_batch, dtype=np.int64) * max_blocks
        # the list each row was written from, held so that its identity stays unique
        self._written: list[list[int] | None] = [None] * max_batch
        # per size: its rows and lengths as tensors and as NumPy arrays (the same memory)
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]] = {}

    def _size_views(self, size: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
        views = self._views.get(size)
        if views is None:
            rows, lens, _ = self.layout.views(self.flat, size)
            views = self._views[size] = (rows, lens, rows.numpy(), lens.numpy())
        return views

    def build(
        self,
        scheduled: Sequence[ScheduledRequest],
        size: int,
        ids_on_device: bool,
        row_tables: Sequence[list[int]] | None = None,
    ) -> HostDecodeStep:
        """For a step of `len(scheduled)` one-token rows padded to `size`: ids, positions and slots
        (padding rows: token 0 at position 0 in the null slot; ids left 0 when `ids_on_device`:
        every row's comes from the previous step's draws; `recurrent`: the state's read and
        written blocks after them), lengths (0 for padding), and the block tables [rows, width],
        width the longest row's blocks. `row_tables`: each row's table, where not its `block_table`
        (a later KV-cache group's). Raises where a position lies past its row's table (the
        scheduler gives every token a slot)."""
        b = len(scheduled)
        bs = self.block_size
        tables, num_blocks, written = self.tables, self.num_blocks, self._written
        width_cap = tables.shape[1]
        for i, sr in enumerate(scheduled):
            table = sr.block_table if row_tables is None else row_tables[i]
            if written[i] is not table:
                n = min(len(table), width_cap)  # blocks past the buffers' width are past every position
                tables[i, :n] = table if n == len(table) else table[:n]
                num_blocks[i] = n
                written[i] = table
        rows_t, lens_t, rows, lens = self._size_views(size)
        if b == 1:  # a batch of one: scalar writes, each a tenth of a NumPy call
            width = self._write_one(scheduled[0], rows, lens, ids_on_device)
        else:
            width = self._write_rows(scheduled, rows, lens, ids_on_device)
        if b < size:  # padding rows: token 0 at position 0 in the null slot, length 0
            rows[:2, b:] = 0
            rows[2, b:] = self.null_slot
            if self.recurrent:
                rows[3, b:] = 0
                rows[4, b:] = self.null_slot // bs
            lens[b:] = 0
        # a padding column is never read: each row's length says how far its table goes
        return HostDecodeStep(rows_t, lens_t, tables[:b, :width], self.layout.span(size, b))

    def _write_one(self, sr: ScheduledRequest, rows: np.ndarray, lens: np.ndarray, ids_on_device: bool) -> int:
        """Row 0 of a step of one request (`_write_rows` for one row); returns its table's width."""
        bs, pos = self.block_size, sr.start
        index = pos // bs
        if index >= self.num_blocks[0]:
            raise IndexError(f"request {sr.req_id}: position {pos} lies past its {int(self.num_blocks[0])} blocks")
        block = int(self.tables[0, index])
        rows[0, 0] = 0 if ids_on_device else sr.token_ids[0]
        rows[1, 0] = pos
        rows[2, 0] = block * bs + pos % bs
        if self.recurrent:
            rows[3, 0] = self.tables[0, max(pos - 1, 0) // bs]
            rows[4, 0] = block
        lens[0] = pos + 1
        return index + 1

    def _write_rows(
        self, scheduled: Sequence[ScheduledRequest], rows: np.ndarray, lens: np.ndarray, ids_on_device: bool
    ) -> int:
        """The first len(scheduled) rows' ids, positions, slots (and state blocks) and lengths, from
        the mirror; returns the widest row's table width."""
        b = len(scheduled)
        bs = self.block_size
        num_blocks = self.num_blocks
        starts = [sr.start for sr in scheduled]
        positions = np.array(starts, dtype=np.int64)
        block_index = positions // bs
        if np.count_nonzero(block_index >= num_blocks[:b]):
            row = int(np.argmax(block_index >= num_blocks[:b]))
            raise IndexError(
                f"request {scheduled[row].req_id}: position {starts[row]} lies past its {int(num_blocks[row])} blocks"
            )
        # few NumPy calls: each costs about a microsecond whatever its size
        rows[0, :b] = 0 if ids_on_device else [sr.token_ids[0] for sr in scheduled]
        rows[1, :b] = positions
        flat, row_starts = self._flat_tables, self._row_starts[:b]
        blocks = flat.take(row_starts + block_index)
        rows[2, :b] = blocks * bs + positions % bs
        if self.recurrent:
            rows[3, :b] = flat.take(row_starts + np.maximum(positions - 1, 0) // bs)
            rows[4, :b] = blocks
        lens[:b] = positions + 1
        return max(starts) // bs + 1 if b else 0
