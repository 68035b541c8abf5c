"""A decode step over inputs of a fixed shape: what a CUDA graph captures once and replays.

A graph replays the launches it recorded on the addresses it recorded, so everything a step varies
lives in tensors allocated once - the slot each new token's K/V goes to, each sequence's block
table (int32, a fixed width) and length (int32) - and the forward reads them without a host
read-back or a shape that depends on them. A batch is padded up to the graph's size: a padding row
writes its K/V to a slot no sequence reads (the caller's null block) and has length 0, which the
decode kernel reads nothing for.

Every new token is a decode (one a sequence); attention is Triton's paged decode kernel
(kernels/triton_attention.paged_decode) reading every context in place - no cascade, no gather,
the split count a function of the fixed shapes only.

A recurrent layer (a Mamba2 mixer, a gated delta net: model/mamba2.py) keeps its state per block:
with `recurrent`, each row also names the block whose state it continues from and the block its
new state goes to (a padding row: any block, and the null block), and whether it has a previous
state at all (position > 0; derived on the device in `prepare`).
"""

from __future__ import annotations

import torch

from .attention_path import triton_kernels


class DecodeLayout:
    """Where a decode step's inputs lie in one flat int32 buffer, the same on the host (page-locked
    on a GPU) and on the device, so that a step's whole input is one contiguous span: one copy
    from memory the host keeps, no per-step staging, no strided copy kernel.

    The block tables sit at a fixed offset (`tables_at`), row i at `tables_at + i * max_blocks`: a
    row written once stays in place for later steps of any size (engine/decode_host_inputs.py keeps
    it as the mirror). Before them, ending exactly there, a step of `size` rows has its header: the
    lengths (int32, padded to an even count) then the int64 rows - ids, positions, slots (and a
    recurrent model's state blocks) - each `size` long. A step of b requests and `size` rows then
    reads the span from its header's start to the end of table row b - 1; each size's views have
    their own strides, fixed for its graph."""

    def __init__(self, max_batch: int, max_blocks: int, recurrent: bool = False) -> None:
        self.max_batch, self.max_blocks = max_batch, max_blocks
        self.rows = 5 if recurrent else 3
        self.tables_at = self.header(max_batch)  # even: int64 views below it stay aligned
        self.length = self.tables_at + max_batch * max_blocks

    def header(self, size: int) -> int:
        """int32 entries of a step's header: its lengths, padded to even, and its int64 rows."""
        return size + size % 2 + 2 * self.rows * size

    def start(self, size: int) -> int:
        return self.tables_at - self.header(size)

    def span(self, size: int, requests: int) -> tuple[int, int]:
        """The entries a step of `size` rows and `requests` requests reads: header and table rows."""
        return self.start(size), self.tables_at + requests * self.max_blocks

    def views(self, flat: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`flat`'s rows [rows, size] int64, lengths [size] int32 and block tables [size, max_blocks]
        int32 for a step of `size` rows (views: the same memory)."""
        if not 0 < size <= self.max_batch:
            raise ValueError(f"a static decode of {size} rows does not fit buffers of {self.max_batch}")
        lo, top = self.start(size), self.tables_at
        lens = flat[lo : lo + size]
        rows = flat[top - 2 * self.rows * size : top].view(torch.int64).view(self.rows, size)
        tables = flat[top : top + size * self.max_blocks].view(size, self.max_blocks)
        return rows, lens, tables


class StaticDecodeInputs:
    """Buffers for decode steps of up to `max_batch` sequences of up to `max_blocks` blocks each, laid
    out by DecodeLayout; `view(size)` gives a step of `size` rows its slices (the same storage)."""

    def __init__(
        self,
        max_batch: int,
        max_blocks: int,
        block_size: int,
        device: torch.device,
        lengths_of: StaticDecodeInputs | None = None,
        recurrent: bool = False,
    ) -> None:
        """`lengths_of`: other inputs whose lengths to share (a later KV-cache group's buffers: its
        own slots and block tables, the same lengths). `recurrent`: rows for the recurrent state's
        blocks too."""
        self.max_batch, self.max_blocks, self.block_size = max_batch, max_blocks, block_size
        self.device = device
        self.layout = DecodeLayout(max_batch, max_blocks, recurrent)
        self.flat = torch.zeros(self.layout.length, dtype=torch.int32, device=device)
        self.recurrent = recurrent
        self.has_prev = torch.zeros(max_batch, dtype=torch.bool, device=device) if recurrent else None
        self.lengths_of = lengths_of

    @property
    def max_context(self) -> int:
        return self.max_blocks * self.block_size

    def view(self, size: int) -> StaticDecodeView:
        return StaticDecodeView(self, size)


class StaticDecodeView:
    """The first `size` rows of the buffers, and the split decode's workspace for that size (one
    per query-head shape, allocated by the first layer that asks and shared by the others)."""

    def __init__(self, inputs: StaticDecodeInputs, size: int) -> None:
        self.size = size
        self.block_size = inputs.block_size
        rows, lens, tables = inputs.layout.views(inputs.flat, size)
        self.rows = rows
        self.input_ids, self.positions, self.slot_mapping = rows[0], rows[1], rows[2]
        self.block_tables = tables
        shared = inputs.lengths_of
        self.seq_lens = lens if shared is None else shared.layout.views(shared.flat, size)[1]
        self.max_context = inputs.max_context
        self.state_read: torch.Tensor | None = None
        self.state_written: torch.Tensor | None = None
        self.has_prev: torch.Tensor | None = None
        if inputs.recurrent and inputs.has_prev is not None:
            self.state_read, self.state_written = rows[3], rows[4]
            self.has_prev = inputs.has_prev[:size]
        self._work: dict[tuple[int, int, int], tuple[int, tuple[torch.Tensor, torch.Tensor] | None]] = {}

    def pad(self, null_slot: int) -> None:
        """Every row a padding row (token 0 at position 0, writing the null slot, length 0; a
        recurrent row reading block 0 and writing the null block): what a capture records over.
        The sizes' headers overlap, so each size is padded just before its own capture."""
        self.rows.zero_()
        self.slot_mapping.fill_(null_slot)
        self.seq_lens.zero_()
        if self.state_written is not None:
            self.state_written.fill_(null_slot // self.block_size)

    def prepare(self) -> None:
        """Derive on the device, once a forward (a capture records it), what every layer reads
        beyond the copied buffers: whether each row continues a recurrent state."""
        if self.has_prev is not None:
            torch.gt(self.positions, 0, out=self.has_prev)

    def attend(
        self,
        q: torch.Tensor,
        k_flat: torch.Tensor,
        v_flat: torch.Tensor,
        scale: float,
        window: int | None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """q [size, Hq, D] against each row's context, K/V [num_slots, Hkv, D] read in place (this
        step's already written); scores soft-capped by `softcap` if given."""
        kernels = triton_kernels()
        _, Hq, D = q.shape
        Hkv = k_flat.shape[1]
        key = (Hq, Hkv, D)
        work = self._work.get(key)
        if work is None:
            splits = kernels.decode_splits(self.size, Hkv, self.max_context, q.device)
            space = kernels.decode_workspace(self.size, Hq, D, splits, q.device) if splits > 1 else None
            work = self._work[key] = (splits, space)
        splits, space = work
        bs = self.block_size
        return kernels.paged_decode(
            q, k_flat.view(-1, bs, *k_flat.shape[1:]), v_flat.view(-1, bs, *v_flat.shape[1:]),
            self.block_tables, self.seq_lens, scale, window=window, num_splits=splits, workspace=space,
            softcap=softcap,
        )  # fmt: skip
