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


class StaticMixedInputs:
    """Buffers for steps of up to `max_tokens` new tokens in up to `max_seqs` sequences of up to
    `max_blocks` blocks each; `view(size)` gives a step of `size` rows its slices."""

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
        # ids, positions and slots as the rows of one tensor: a step copies them in at once
        self.tokens = torch.zeros(3, max_tokens, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(max_seqs + 1, max_blocks, dtype=torch.int32, device=device)
        # each sequence's first row, new tokens and length (int32); column max_seqs: the padding
        # sequence, of no tokens, that unused tiles name
        self.seqs: torch.Tensor
        self.tile_map: torch.Tensor
        self.scan = (
            None if conv_kernel is None else StaticScanInputs(max_tokens, max_seqs, block_size, conv_kernel, device)
        )
        if layout is not None:
            self.seqs, self.tile_map = layout.seqs, layout.tile_map
            return
        self.seqs = torch.zeros(3, max_seqs + 1, dtype=torch.int32, device=device)
        self.tile_map = torch.zeros(2, tiles_for(max_tokens, max_seqs, tile_tokens), dtype=torch.int32, device=device)
        self.tile_map[0].fill_(max_seqs)

    @property
    def max_context(self) -> int:
        return self.max_blocks * self.block_size

    @property
    def padding_seq(self) -> int:
        return self.max_seqs

    def view(self, size: int) -> StaticMixedView:
        if not 0 < size <= self.max_tokens:
            raise ValueError(f"a static step of {size} tokens does not fit buffers of {self.max_tokens}")
        return StaticMixedView(self, size)


class StaticMixedView:
    """The first `size` token rows and `tiles` tile-map columns of the buffers (the same storage);
    every sequence's entries whatever the size (the tile map names them)."""

    def __init__(self, inputs: StaticMixedInputs, size: int) -> None:
        self.size = size
        self.block_size = inputs.block_size
        self.tile_tokens = inputs.tile_tokens
        self.input_ids = inputs.tokens[0, :size]
        self.positions = inputs.tokens[1, :size]
        self.slot_mapping = inputs.tokens[2, :size]
        self.q_start, self.q_len, self.seq_lens = inputs.seqs
        self.block_tables = inputs.block_tables
        self.tiles = tiles_for(size, inputs.max_seqs, inputs.tile_tokens)
        self.tile_map = inputs.tile_map[:, : self.tiles]
        self.max_context = inputs.max_context
        self.scan: StaticScanView | None = None if inputs.scan is None else inputs.scan.view(size)

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
