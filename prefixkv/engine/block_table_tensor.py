"""A step's block tables as one host tensor [rows, width], each row's block ids then zeros (a
padding column is never read: each sequence's length says how far its row goes).

Built in NumPy: `torch.tensor` of the padded nested lists took 0.57 ms at 256 rows of 18 blocks on
a 2-vCPU AMD EPYC Zen 4, row-by-row NumPy 0.17 ms - host time in every eager step
(bench/host_overhead.py). The ids go through one `np.fromiter` over them all and one masked store:
0.28 ms against the row-by-row 0.49 ms on a Zen 3 (most of it converting Python ints). A replayed
decode step keeps its tables from step to step instead (decode_host_inputs.py)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch


def padded_block_tables(tables: Sequence[Sequence[int]], dtype: torch.dtype) -> torch.Tensor:
    """[len(tables), width] of `dtype`: row i holds tables[i], zeros after; width is the longest
    row's."""
    lengths = [len(t) for t in tables]
    width = max(lengths, default=0)
    out = np.zeros((len(lengths), width), dtype=np.int64 if dtype == torch.long else np.int32)
    flat = np.fromiter(chain.from_iterable(tables), dtype=out.dtype, count=sum(lengths))
    out[np.arange(width) < np.asarray(lengths)[:, None]] = flat
    return torch.from_numpy(out)
