"""A step of any mix - prompts, chunks after cached context, decodes - over inputs of a fixed shape:
what a CUDA graph captures once per token count and replays (static_decode.py is the all-decode
step's counterpart, whose split decode kernel reads a long context faster).

The step's tokens are `size` rows (ids, positions, slots), padded up: a padding row writes its K/V
to a slot no sequence reads (the caller's null block) and belongs to no sequence, so attention
writes nothing to it (its row holds whatever the memory held, and stays in its row: every other
operation of the forward is row by row). Each sequence's rows, new tokens, length and block table
live in buffers of `max_seqs` + 1 entries, the last a sequence of no tokens. Attention is Triton's
prefill kernel over a fixed grid (kernels/triton_attention.paged_prefill_tiles): the host says
which sequence and which tile of it each program takes (`tile_map`), so the launch never depends
on the lengths.
"""

from __future__ import annotations

import torch

from .attention_path import triton_kernels
from .static_scan import StaticScanInputs, StaticScanView


def tiles_for(tokens: int, max_seqs: int, tile_tokens: int) -> int:
    """Programs (per KV head) a step of `tokens` rows needs at the most: a sequence of n new tokens
    takes ceil(n / tile_tokens) <= n // tile_tokens + 1 tiles, and there are at most
    min(tokens, max_seqs) sequences."""
    return tokens // tile_tokens + min(tokens, max_seqs)


class MixedLayout:
    """Where a mixed step's inputs lie in one flat int32 buffer, the same on the host (page-locked on
    a GPU) and on the device (static_decode.DecodeLayout's scheme): the block tables, a row per
    sequence, at a fixed offset (`tables_at`); before them, ending there, a step of `size` rows has
    its header - the tile map [2, tiles], each sequence's first row, new tokens and length [3,
    max_seqs + 1], then the ids, positions and slots [3, size] (int64). A step of n sequences reads
    the span from its header's start to the end of table row n - 1: one copy."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, tile_tokens: int) -> None:
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        self.tile_tokens = tile_tokens
        self.tables_at = self.header(max_tokens)
        self.tables_at += self.tables_at % 2  # even: the int64 rows below it stay aligned
        self.length = self.tables_at + (max_seqs + 1) * max_blocks

    def tiles(self, size: int) -> int:
        return tiles_for(size, self.max_seqs, self.tile_tokens)

    def header(self, size: int) -> int:
        return 2 * self.tiles(size) + 3 * (self.max_seqs + 1) + 6 * size

    def start(self, size: int) -> int:
        return self.tables_at - self.header(size)

    def span(self, size: int, seqs: int) -> tuple[int, int]:
        """The entries a step of `size` rows and `seqs` sequences reads: header and table rows."""
        return self.start(size), self.tables_at + seqs * self.max_blocks

    def views(self, flat: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`flat`'s tokens [3, size] int64 (ids, positions, slots), sequences [3, max_seqs + 1],
        tile map [2, tiles] and block tables [max_seqs + 1, max_blocks] int32 for a step of `size`
        rows (views: the same memory)."""
        if not 0 < size <= self.max_tokens:
            raise ValueError(f"a static step of {size} tokens does not fit buffers of {self.max_tokens}")
        at, top, tiles, width = self.start(size), self.tables_at, self.tiles(size), self.max_seqs + 1
        tile_map = flat[at : at + 2 * tiles].view(2, tiles)
        seqs = flat[at + 2 * tiles : at + 2 * tiles + 3 * width].view(3, width)
        tokens = flat[top - 6 * size : top].view(torch.int64).view(3, size)
        tables = flat[top : top + width * self.max_blocks].view(width, self.max_blocks)
        return tokens, seqs, tile_map, tables


class StaticMixedInputs:
    """Buffers for steps of up to `max_tokens` new tokens in up to `max_seqs` sequences of up to
    `max_blocks` blocks each, laid out by MixedLayout; `view(size)` gives a step of `size` rows its
    slices."""

    def __init__(
        self,
        max_tokens: int,
        max_seqs: int,
        max_blocks: int,
        block_size: int,
        tile_tokens: int,
        device: torch.device,
        layout: StaticMixedInputs | None = None,
        conv_kernel: int | None = None,
    ) -> None:
        """`layout`: another inputs' sequences and tile map to share (a later KV-cache group's
        buffers: its own slots and block tables, the same step). `conv_kernel`: the model's layers
        keep a recurrent state (model/mamba2.py, its conv that wide): the scan's buffers too
        (static_scan.py)."""
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        self.block_size, self.tile_tokens = block_size, tile_tokens
        self.device = device
        self.layout = MixedLayout(max_tokens, max_seqs, max_blocks, tile_tokens)
        self.flat = torch.zeros(self.layout.length, dtype=torch.int32, device=device)
        self.shared = layout
        self.scan = (
            None if conv_kernel is None else StaticScanInputs(max_tokens, max_seqs, block_size, conv_kernel, device)
        )

    @property
    def max_context(self) -> int:
        return self.max_blocks * self.block_size

    @property
    def padding_seq(self) -> int:
        """The sequence of no tokens (column max_seqs) that unused tiles name."""
        return self.max_seqs

    def view(self, size: int) -> StaticMixedView:
        return StaticMixedView(self, size)


class StaticMixedView:
    """A step of `size` token rows and `tiles` tile-map columns over the buffers (the same storage);
    every sequence's entries whatever the size (the tile map names them)."""

    def __init__(self, inputs: StaticMixedInputs, size: int) -> None:
        self.size = size
        self.block_size = inputs.block_size
        self.tile_tokens = inputs.tile_tokens
        tokens, seqs, tile_map, tables = inputs.layout.views(inputs.flat, size)
        if inputs.shared is not None:  # the step's sequences and tile map are another inputs'
            _, seqs, tile_map, _ = inputs.shared.layout.views(inputs.shared.flat, size)
        self.tokens = tokens
        self.input_ids, self.positions, self.slot_mapping = tokens[0], tokens[1], tokens[2]
        self.seqs = seqs
        self.q_start, self.q_len, self.seq_lens = seqs
        self.block_tables = tables
        self.tiles = inputs.layout.tiles(size)
        self.tile_map = tile_map
        self.padding_seq = inputs.padding_seq
        self.max_context = inputs.max_context
        self.scan: StaticScanView | None = None if inputs.scan is None else inputs.scan.view(size)

    def pad(self, null_slot: int) -> None:
        """Every row a padding row writing the null slot, every sequence of no tokens, every tile the
        padding sequence's: what a capture records over. The sizes' headers overlap, so each size is
        padded just before its own capture."""
        self.tokens.zero_()
        self.slot_mapping.fill_(null_slot)
        self.seqs.zero_()
        self.tile_map[0].fill_(self.padding_seq)
        self.tile_map[1].zero_()

    def prepare(self) -> None:
        """What the layers derive from the buffers beyond the copies (the scan's mask), recorded
        into the graph."""
        if self.scan is not None:
            self.scan.prepare()

    def attend(
        self,
        q: torch.Tensor,
        k_flat: torch.Tensor,
        v_flat: torch.Tensor,
        scale: float,
        window: int | None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """q [size, Hq, D] against each sequence's context and its new rows up to each (causal), K/V
        [num_slots, Hkv, D] read in place (this step's already written), scores soft-capped by
        `softcap` if given; padding rows not written."""
        out = torch.empty_like(q)
        bs = self.block_size
        return triton_kernels().paged_prefill_tiles(
            q, k_flat.view(-1, bs, *k_flat.shape[1:]), v_flat.view(-1, bs, *v_flat.shape[1:]), self.block_tables,
            self.q_start, self.q_len, self.seq_lens, self.tile_map, self.tile_tokens, scale, out, window=window,
            softcap=softcap,
        )  # fmt: skip
