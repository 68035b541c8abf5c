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


def test_whole_tables_at_once_equal_row_by_row():
    """Whole tables (no lengths, or lengths equal to them) take the one-pass path; shorter lengths
    the row-by-row one: the same rows either way, large ids included."""
    import random

    rng = random.Random(7)
    tables = [[rng.randrange(2**31 - 1) for _ in range(rng.randrange(0, 20))] for _ in range(50)]
    want = [t + [0] * (max(map(len, tables)) - len(t)) for t in tables]
    for dtype in (torch.long, torch.int32):
        assert padded_block_tables(tables, dtype).tolist() == want
        assert padded_block_tables(tables, dtype, [len(t) for t in tables]).tolist() == want
    cut = [max(0, len(t) - 1) for t in tables]
    width = max(cut)
    assert padded_block_tables(tables, torch.long, cut).tolist() == [
        t[:n] + [0] * (width - n) for t, n in zip(tables, cut)
    ]
