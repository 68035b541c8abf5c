"""A mixed step's recurrent layers over fixed buffers (static_mixed.py's step; model/mamba2.py's
scan, model/gated_delta.py's): what a CUDA graph of a recurrent model's mixed step replays.

The eager scan takes a plan the host makes per step - requests cut into block-aligned segments,
the recurrence across them in rounds, the conv request by request - whose shapes follow the blocks
the prompts cross. Over fixed buffers every size has its most segments (`segments_for`), and each
shape is that bound's: the segments' token rows (`pad_index`, padding slots the step's zero row),
the block each segment's final state goes to (padding: the null block), each row's segment slot,
each request's chain of segments in order (walked by one Triton kernel, kernels/triton_scan.py),
and the conv's inputs as windows of row indices into one table - the step's rows, then each
request's conv state before its chunk, then a zero row - for every row's output and every
segment's final state. Each request's state block to continue from, and whether it has one, are two
more rows beside them.
"""

from __future__ import annotations

import torch


def segments_for(tokens: int, max_seqs: int, block_size: int) -> int:
    """The most block-aligned segments a step of `tokens` new tokens in at most `max_seqs` requests
    cuts: a request of n tokens touches at most n // block_size + 2 blocks (n = block_size + 2
    from a block's last position: three), and a segment holds at least one token."""
    return min(tokens, tokens // block_size + 2 * min(tokens, max_seqs))


class StaticScanInputs:
    """The plan's buffers for steps of up to `max_tokens` rows and `max_seqs` requests (entry
    max_seqs of the per-request ones: the padding request, of no segments)."""

    def __init__(self, max_tokens: int, max_seqs: int, block_size: int, conv_kernel: int, device: torch.device) -> None:
        self.max_seqs, self.block_size, self.conv_kernel = max_seqs, block_size, conv_kernel
        segments = segments_for(max_tokens, max_seqs, block_size)
        long, i32 = torch.long, torch.int32
        self.states = torch.zeros(2, max_seqs + 1, dtype=long, device=device)  # block to continue from; 1: has one
        self.has_prev = torch.zeros(max_seqs + 1, dtype=torch.bool, device=device)  # states[1] > 0, derived
        self.pad_index = torch.zeros(segments, block_size, dtype=long, device=device)
        self.seg_blocks = torch.zeros(segments, dtype=long, device=device)
        self.out_index = torch.zeros(max_tokens, dtype=long, device=device)
        # a chain: a request's segments, after those of the request it continues from in the step
        self.chains = torch.zeros(max_seqs + 1, segments, dtype=i32, device=device)
        self.chain_len = torch.zeros(max_seqs + 1, dtype=i32, device=device)
        self.conv_rows = torch.zeros(max_tokens, conv_kernel, dtype=long, device=device)
        self.conv_ends = torch.zeros(segments, conv_kernel - 1, dtype=long, device=device)

    def view(self, size: int) -> StaticScanView:
        return StaticScanView(self, size)


class StaticScanView:
    """A step of `size` rows: its segments' slices of the buffers (the same storage)."""

    def __init__(self, inputs: StaticScanInputs, size: int) -> None:
        segments = segments_for(size, inputs.max_seqs, inputs.block_size)
        self.segments = segments
        self.state_read = inputs.states[0]
        self.states = inputs.states
        self.pad_index = inputs.pad_index[:segments]
        self.seg_blocks = inputs.seg_blocks[:segments]
        self.out_index = inputs.out_index[:size]
        self.chains = inputs.chains
        self.chain_len = inputs.chain_len
        self.conv_rows = inputs.conv_rows[:size]
        self.conv_ends = inputs.conv_ends[:segments]
        self.has_prev = inputs.has_prev

    def prepare(self) -> None:
        """Whether each request continues a state, as a mask, from its buffer row (copied in as an
        integer beside the block): written in place, as every layer's plan holds the buffer, and
        recorded into the graph."""
        torch.gt(self.states[1], 0, out=self.has_prev)
