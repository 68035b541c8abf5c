"""engine/block_table_tensor.padded_block_tables: each row's block ids, zeros after, as the dtype
asked for."""

from __future__ import annotations

import random

import torch

from prefixkv.engine.block_table_tensor import padded_block_tables


def test_rows_are_padded_with_zeros_to_the_longest():
    got = padded_block_tables([[5, 9, 2], [7], []], torch.long)
    assert got.dtype == torch.long
    assert got.tolist() == [[5, 9, 2], [7, 0, 0], [0, 0, 0]]
    assert padded_block_tables([[7, 3, 1]], torch.int32).dtype == torch.int32


def test_no_rows():
    assert padded_block_tables([], torch.long).shape == (0, 0)


def test_the_one_pass_build_equals_the_rows_padded_one_by_one():
    """All the ids go through one pass and one masked store: the same rows as padding each, large
    ids included."""
    rng = random.Random(7)
    tables = [[rng.randrange(2**31 - 1) for _ in range(rng.randrange(0, 20))] for _ in range(50)]
    want = [t + [0] * (max(map(len, tables)) - len(t)) for t in tables]
    for dtype in (torch.long, torch.int32):
        assert padded_block_tables(tables, dtype).tolist() == want
