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


class StaticDecodeInputs:
    """Buffers for decode steps of up to `max_batch` sequences of up to `max_blocks` blocks each;
    `view(size)` gives a step of `size` rows its slices (the same storage)."""

    def __init__(
        self,
        max_batch: int,
        max_blocks: int,
        block_size: int,
        device: torch.device,
        seq_lens: torch.Tensor | None = None,
        recurrent: bool = False,
    ) -> None:
        """`seq_lens`: another inputs' lengths to share (a later KV-cache group's buffers: its own
        slots and block tables, the same lengths). `recurrent`: rows for the recurrent state's
        blocks too."""
        self.max_batch, self.max_blocks, self.block_size = max_batch, max_blocks, block_size
        self.device = device
        # ids, positions and slots (and the state's read and written blocks) as the rows of one
        # tensor: a step copies them in at once
        self.tokens = torch.zeros(5 if recurrent else 3, max_batch, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.slot_mapping = self.tokens[0], self.tokens[1], self.tokens[2]
        self.state_blocks = self.tokens[3:] if recurrent else None  # [read, written] per row
        self.has_prev = torch.zeros(max_batch, dtype=torch.bool, device=device) if recurrent else None
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        if seq_lens is None:
            seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.seq_lens = seq_lens

    @property
    def max_context(self) -> int:
        return self.max_blocks * self.block_size

    def view(self, size: int) -> StaticDecodeView:
        if not 0 < size <= self.max_batch:
            raise ValueError(f"a static decode of {size} rows does not fit buffers of {self.max_batch}")
        return StaticDecodeView(self, size)


class StaticDecodeView:
    """The first `size` rows of the buffers, and the split decode's workspace for that size (one
    per query-head shape, allocated by the first layer that asks and shared by the others)."""

    def __init__(self, inputs: StaticDecodeInputs, size: int) -> None:
        self.size = size
        self.block_size = inputs.block_size
        self.input_ids = inputs.input_ids[:size]
        self.positions = inputs.positions[:size]
        self.slot_mapping = inputs.slot_mapping[:size]
        self.block_tables = inputs.block_tables[:size]
        self.seq_lens = inputs.seq_lens[:size]
        self.max_context = inputs.max_context
        self.state_read: torch.Tensor | None = None
        self.state_written: torch.Tensor | None = None
        self.has_prev: torch.Tensor | None = None
        if inputs.state_blocks is not None and inputs.has_prev is not None:
            self.state_read, self.state_written = inputs.state_blocks[:, :size]
            self.has_prev = inputs.has_prev[:size]
        self._work: dict[tuple[int, int, int], tuple[int, tuple[torch.Tensor, torch.Tensor] | None]] = {}

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
