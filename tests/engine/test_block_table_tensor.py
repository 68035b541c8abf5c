"""engine/block_table_tensor.padded_block_tables: each row's block ids (or their first `lengths`),
zeros after, as the dtype asked for."""

from __future__ import annotations

import torch

from prefixkv.engine.block_table_tensor import padded_block_tables


def test_rows_are_padded_with_zeros_to_the_longest():
    got = padded_block_tables([[5, 9, 2], [7], []], torch.long)
    assert got.dtype == torch.long
    assert got.tolist() == [[5, 9, 2], [7, 0, 0], [0, 0, 0]]


def test_lengths_cut_each_row_and_set_the_width():
    got = padded_block_tables([[5, 9, 2, 8], [7, 3, 1]], torch.int32, lengths=[2, 1])
    assert got.dtype == torch.int32
    assert got.tolist() == [[5, 9], [7, 0]]


def test_no_rows():
    assert padded_block_tables([], torch.long).shape == (0, 0)
