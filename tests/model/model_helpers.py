"""Helpers to drive the paged model path from tests."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from prefixkv.model import AttentionMetadata
from prefixkv.model.kernels import ops


def make_step(seqs, block_size):
    """seqs: list of (token_ids_all, block_ids, num_cached) -> (input_ids, positions, meta).

    Each sequence contributes tokens token_ids_all[num_cached:] as new tokens.
    """
    ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
    max_blocks = max(len(b) for _, b, _ in seqs)
    tables = []
    for toks, blocks, cached in seqs:
        n = len(toks)
        assert len(blocks) * block_size >= n
        for p in range(cached, n):
            ids.append(toks[p])
            pos.append(p)
            slots.append(blocks[p // block_size] * block_size + p % block_size)
        qsl.append(qsl[-1] + n - cached)
        seq_lens.append(n)
        tables.append(list(blocks) + [0] * (max_blocks - len(blocks)))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_tables=torch.tensor(tables, dtype=torch.long),
    )
    return torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long), meta


def run_logits(model, caches, seqs, block_size):
    """Run one step; return logits of all new tokens [T, vocab] and the per-seq row splits."""
    ids, pos, meta = make_step(seqs, block_size)
    h = model(ids, pos, caches, meta)
    return model.compute_logits(h), meta.query_start_loc


def scattered_blocks(n_tokens, block_size, pool, generator):
    nb = (n_tokens + block_size - 1) // block_size
    perm = torch.randperm(pool, generator=generator)[:nb].tolist()
    return perm


@contextlib.contextmanager
def without_blocked_linear(*dtypes: torch.dtype, tolerated: bool = False) -> Iterator[None]:
    """Models packed inside the block lay their weights out as where the many-row native linear lost
    its timing to oneDNN (kernel_choice): oneDNN's layout, and a second for decode where it fits.
    `tolerated`: as where it timed within the tolerance but slower - one native layout only where a
    second copy would not fit."""
    before = {dt: ops.choice(dt) for dt in dtypes}
    for dt, made in before.items():
        choice = dataclasses.replace(made or ops.KernelChoice(), blocked_linear=tolerated, blocked_linear_faster=False)
        ops.set_choice(dt, choice)
    try:
        yield
    finally:
        for dt, made in before.items():
            ops.set_choice(dt, made)
