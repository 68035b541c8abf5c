"""The worker half of the KV tiers' connector: copies whole blocks between the per-block tensors
and bytes, and seals what it copies out into values (value.py) for the scheduler half to store.

A block's bytes are, in order, each KV layer's `[2, block_size, kv_heads, head_dim]` slice (model
dtype), then - with the stage-output cache on - the block's rows of every stage-output tensor
(`[block_size, D]`: hidden states, ...), so a block's stage outputs travel with its KV into the
tiers and back, under the same checks.

A step's blocks move together: one gather (saves) or scatter (loads) per tensor, whatever their
number. On a CPU they gather straight into a reused host buffer of one row of bytes per block.
On a GPU they go through a reused device buffer, laid out tensor by tensor, and page-locked host
memory, and the copies take their place in the stream without the host waiting: loads land
before the forward that reads them; saves are copied out after the forward that wrote them and
sealed when the step is booked (`StagedSaves.result`). So a step with tier traffic does not hold
the host until the step before it is done (async scheduling, engine/llm_engine.py).

The stage-output cache's rows are written into host memory when a step is booked, not when it is
launched (stage_outputs/store.py), so their share of a block moves then too, on the host: a save
gathers it when it is sealed, a load scatters it when `PendingLoads.finish` is called. Steps are
booked in the order they were launched, so those rows change in the order an engine that waits
for every step would change them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..model.host_copy import tensor_on
from .plans import KVLoad, KVSave, SavedBlock
from .value import seal

_ALIGN = 64  # bytes: each tensor's region of the staging buffer starts here, viewable in any dtype
STAGE_BYTES = 16 << 20  # at most this much staged at once (more blocks: more copies; a GPU reserves it)


def block_nbytes(parts: Sequence[tuple[torch.Tensor, int]]) -> int:
    """Bytes of one block across `parts` ((tensor, block axis) pairs)."""
    return sum(t.select(dim, 0).numel() * t.element_size() for t, dim in parts)


@dataclass(frozen=True, slots=True)
class _Part:
    """One tensor's share of a block: at `offset` in the block's bytes, `outer` runs (the
    product of the dimensions before the block axis) of `inner` bytes each."""

    tensor: torch.Tensor
    dim: int
    offset: int
    outer: int
    inner: int
    booked: bool  # rows in host memory that the engine writes when a step is booked (the stage-output cache's)

    def staged_shape(self, n: int) -> tuple[int, ...]:
        """The shape of `n` blocks gathered along the block axis."""
        s = self.tensor.shape
        return (*s[: self.dim], n, *s[self.dim + 1 :])


class BlockTransfer:
    def __init__(
        self,
        parts: Sequence[tuple[torch.Tensor, int]],
        secret: bytes | None = None,
        *,
        booked: int = 0,
        through_host: bool = False,
        stage_bytes: int = STAGE_BYTES,
    ) -> None:
        """`parts`: (tensor, its block axis) of everything a block carries, in value order, on the
        first one's device. `secret`: the tier secret, whose MAC seals every value (never logged).
        `booked`: how many of the last parts are rows in host memory that the engine writes when
        a step is booked (the stage-output cache's): saves gather them when sealed, loads scatter
        them in `PendingLoads.finish`. `through_host`: stage the copies through a device buffer and
        host memory even on a CPU (what they always do on a GPU), so that the GPU's path runs
        without one. `stage_bytes`: the most one gather or scatter moves (more blocks: more of them)."""
        self.parts = list(parts)
        self._secret = secret
        self.nbytes = block_nbytes(self.parts)
        self._device = self.parts[0][0].device
        self._pin = self._device.type == "cuda"
        self._layout: list[_Part] = []
        offset = 0
        for i, (t, dim) in enumerate(self.parts):
            outer = math.prod(t.shape[:dim])
            size = t.select(dim, 0).numel() * t.element_size()
            is_booked = i >= len(self.parts) - booked
            if is_booked and t.device.type != "cpu":
                raise ValueError(f"rows written when a step is booked must be in host memory, not on {t.device}")
            if not is_booked and t.device != self._device:
                raise ValueError(f"a block's tensors on {t.device} and {self._device}")
            self._layout.append(_Part(t, dim, offset, outer, size // outer, is_booked))
            offset += size
        # the host rows are viewed in each tensor's dtype: its bytes must start on its elements
        rows_fit = all(
            p.offset % p.tensor.element_size() == 0 and offset % p.tensor.element_size() == 0 for p in self._layout
        )
        # a save sealed when booked keeps its own buffer until then: the direct path reuses one
        self._through_host = through_host or self._device.type != "cpu" or not rows_fit or booked > 0
        self._per_copy = max(1, stage_bytes // self.nbytes)  # blocks moved by one gather or scatter
        # Reused, grown on demand: the host's rows of one block's bytes each, the device's
        # staging buffer (through the host), and per number of blocks the views each tensor's
        # blocks are gathered into or scattered from (building them cost more than the copies of
        # one block, timed on a CPU). Page-locked memory comes fresh from PyTorch's caching host
        # allocator, which keeps it until the copies reading it are done
        self._rows = torch.empty(0, dtype=torch.uint8)
        self._stage = torch.empty(0, dtype=torch.uint8, device=self._device)
        self._views: dict[int, list[torch.Tensor | None]] = {}

    def _regions(self, n: int) -> tuple[list[int], int, int]:
        """Where each tensor's `n` blocks start in a staging buffer (the device's tensors first,
        then the booked rows), its size, and the size of the device's share."""
        starts = [0] * len(self._layout)
        at = device_total = 0
        for booked in (False, True):
            for i, part in enumerate(self._layout):
                if part.booked == booked:
                    starts[i] = at
                    at += -(-(n * part.outer * part.inner) // _ALIGN) * _ALIGN
            if not booked:
                device_total = at
        return starts, at, device_total

    @staticmethod
    def _staged(buffer: torch.Tensor, start: int, part: _Part, n: int) -> torch.Tensor:
        """`n` blocks of `part` gathered along its block axis, in `buffer` from `start`."""
        region = buffer[start : start + n * part.outer * part.inner]
        return region.view(part.tensor.dtype).view(part.staged_shape(n))

    def _rows_for(self, n: int) -> torch.Tensor:
        """The reused host buffer as `n` rows of one block's bytes."""
        if self._rows.numel() < n * self.nbytes:
            self._rows = torch.empty(n * self.nbytes, dtype=torch.uint8)
            if not self._through_host:
                self._views.clear()  # they were views of the old buffer
        return self._rows[: n * self.nbytes].view(n, self.nbytes)

    def _gather_views(self, n: int) -> list[torch.Tensor | None]:
        """Each tensor's `n` blocks (gathered along its block axis), as views of the host rows
        (direct) or of the device staging buffer (through the host; booked rows have none there,
        and are gathered into the host buffer itself)."""
        cached = self._views.get(n)
        if cached is not None:
            return cached
        views: list[torch.Tensor | None] = []
        if self._through_host:
            starts, _, device_total = self._regions(n)
            if self._stage.numel() < device_total:
                self._stage = torch.empty(device_total, dtype=torch.uint8, device=self._device)
                self._views.clear()
            views = [
                None if part.booked else self._staged(self._stage, start, part, n)
                for part, start in zip(self._layout, starts)
            ]
        else:
            rows = self._rows_for(n)
            for part in self._layout:
                one = part.tensor.select(part.dim, 0)
                own = rows[:, part.offset : part.offset + part.outer * part.inner].view(part.tensor.dtype)
                views.append(own.view(n, *one.shape).movedim(0, part.dim))
        self._views[n] = views
        return views

    @torch.inference_mode()
    def load(self, loads: Sequence[KVLoad]) -> PendingLoads:
        """Copy checked bytes into their blocks, before the forward that reads them (in stream
        order on a GPU); the booked rows when `finish` is called on what this returns."""
        pending = PendingLoads()
        for at in range(0, len(loads), self._per_copy):
            self._load(loads[at : at + self._per_copy], pending)
        return pending

    def _load(self, loads: Sequence[KVLoad], pending: PendingLoads) -> None:
        n = len(loads)
        rows = self._rows_for(n).numpy()
        for i, load in enumerate(loads):
            rows[i] = np.frombuffer(load.kv, dtype=np.uint8)
        views = self._gather_views(n)
        block_ids = [load.block_id for load in loads]
        if self._through_host:
            starts, total, device_total = self._regions(n)
            host = torch.empty(total, dtype=torch.uint8, pin_memory=self._pin)
            self._relayout(host.numpy(), starts, rows, into_rows=False)
            self._stage[:device_total].copy_(host[:device_total], non_blocking=self._pin)
            views = [
                self._staged(host, start, part, n) if part.booked else view
                for part, start, view in zip(self._layout, starts, views)
            ]
        ids = tensor_on(block_ids, self._device, torch.long)
        host_ids = None
        for part, view in zip(self._layout, views):
            assert view is not None
            if part.booked:  # a view of this call's own host buffer: kept until then
                host_ids = torch.tensor(block_ids) if host_ids is None else host_ids
                pending.rows.append((part, host_ids, view))
            else:
                part.tensor.index_copy_(part.dim, ids, view)

    @torch.inference_mode()
    def save(self, saves: Sequence[KVSave]) -> StagedSaves:
        """Copy completed blocks out (after the forward that wrote them), sealed at once when
        copied straight to the host, else when first read (when the step is booked)."""
        staged = StagedSaves(self)
        for at in range(0, len(saves), self._per_copy):
            staged.add(self._save(saves[at : at + self._per_copy]))
        return staged

    def _save(self, saves: Sequence[KVSave]) -> _Copy | list[SavedBlock]:
        """Gather the blocks: straight into the host rows, sealed at once (before the rows are
        reused); or through the host, the copy there started."""
        n = len(saves)
        block_ids = [save.block_id for save in saves]
        ids = tensor_on(block_ids, self._device, torch.long)
        if not self._through_host:
            for part, view in zip(self._layout, self._gather_views(n)):
                assert view is not None
                torch.index_select(part.tensor, part.dim, ids, out=view)
            return self._seal(saves, self._rows_for(n))
        starts, total, device_total = self._regions(n)
        host = torch.empty(total, dtype=torch.uint8, pin_memory=self._pin)
        for part, view in zip(self._layout, self._gather_views(n)):
            if view is not None:  # booked rows are gathered when sealed (finish)
                torch.index_select(part.tensor, part.dim, ids, out=view)
        host[:device_total].copy_(self._stage[:device_total], non_blocking=self._pin)
        done = None
        if self._pin:
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record()
        return _Copy(list(saves), host, starts, done)

    def _relayout(self, staged: np.ndarray, starts: list[int], rows: np.ndarray, into_rows: bool) -> None:
        """Copy between `rows` (one block's bytes each) and `staged` (each tensor's blocks
        together, from `starts`), into the rows or out of them."""
        n = len(rows)
        for part, start in zip(self._layout, starts):
            by_block = rows[:, part.offset : part.offset + part.outer * part.inner].reshape(n, part.outer, part.inner)
            by_tensor = staged[start : start + n * part.outer * part.inner].reshape(part.outer, n, part.inner)
            if into_rows:
                by_block[:] = by_tensor.transpose(1, 0, 2)
            else:
                by_tensor[:] = by_block.transpose(1, 0, 2)

    @torch.inference_mode()
    def finish(self, copy: _Copy) -> list[SavedBlock]:
        """The values of a copy through the host, once it is done, with the booked rows as they
        are now (the step that wrote them has been booked)."""
        if copy.done is not None:
            copy.done.synchronize()
        n = len(copy.saves)
        host_ids = None
        for part, start in zip(self._layout, copy.starts):
            if part.booked:
                host_ids = torch.tensor([s.block_id for s in copy.saves]) if host_ids is None else host_ids
                torch.index_select(part.tensor, part.dim, host_ids, out=self._staged(copy.staged, start, part, n))
        rows = self._rows_for(n)
        self._relayout(copy.staged.numpy(), copy.starts, rows.numpy(), into_rows=True)
        return self._seal(copy.saves, rows)

    def _seal(self, saves: Sequence[KVSave], rows: torch.Tensor) -> list[SavedBlock]:
        """Each block's value from its row of bytes (for a save with an `owner`, its KV bytes
        alone: KVSave.owner)."""
        values = []
        for save, row in zip(saves, rows.numpy()):
            data = row.data
            if save.owner is not None:  # keyed and sealed when its last token is known (KVSave.owner)
                values.append(SavedBlock(save, bytes(data)))
            else:
                values.append(SavedBlock(save, seal(save.head, data, save.key, self._secret)))
        return values


@dataclass(slots=True)
class _Copy:
    """Some of a step's saves on their way to host memory `staged` (in stream order), each
    tensor's blocks from `starts` (BlockTransfer._regions); `done` is recorded after the copy
    (None: done already)."""

    saves: list[KVSave]
    staged: torch.Tensor
    starts: list[int]
    done: torch.cuda.Event | None


class StagedSaves:
    """A step's saves copied out, sealed into values when first read (`result`)."""

    __slots__ = ("_transfer", "_parts", "_values")

    def __init__(self, transfer: BlockTransfer) -> None:
        self._transfer = transfer
        self._parts: list[_Copy | list[SavedBlock]] = []  # in the saves' order: copies, or sealed
        self._values: list[SavedBlock] | None = None

    def add(self, part: _Copy | list[SavedBlock]) -> None:
        self._parts.append(part)

    def result(self) -> list[SavedBlock]:
        """The values, in the saves' order, waiting for the copies if they are still running."""
        if self._values is None:
            finish = self._transfer.finish
            self._values = [v for p in self._parts for v in (p if isinstance(p, list) else finish(p))]
            self._parts = []  # the page-locked memory goes back
        return self._values


class PendingLoads:
    """A step's loads whose booked rows (the stage-output cache's) are still to go into their
    blocks: `finish` puts them there, once (when the step is booked, or at once where nothing
    launched before it is unbooked)."""

    __slots__ = ("rows",)

    def __init__(self) -> None:
        # (a booked part, the blocks' ids, their rows in that part's layout)
        self.rows: list[tuple[_Part, torch.Tensor, torch.Tensor]] = []

    @torch.inference_mode()
    def finish(self) -> None:
        rows, self.rows = self.rows, []
        for part, ids, view in rows:
            part.tensor.index_copy_(part.dim, ids, view)
