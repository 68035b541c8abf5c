"""Chunks after cached context in one padded attention (`_ChunkBatch`, model/attention.py: the
path of CUDA and of a CPU without the native kernels) give what attending to each chunk alone
gives: with and without the cascade over a shared prefix, beside decodes and fresh prompts, with a
sliding window, GQA or not, and where padding would cost too much they still run one by one."""

from __future__ import annotations

import pytest
import torch

from prefixkv.model import AttentionMetadata
from prefixkv.model.attention import _ChunkBatch, paged_attention
from prefixkv.model.kernels import ops

BS = 16


def _step(seqs, Hq, Hkv, D, dtype, seed=0):
    """seqs: (sequence length, new tokens, block ids) -> q, k, v of the new tokens, a KV cache with
    random context already written, and the step's metadata."""
    g = torch.Generator().manual_seed(seed)
    blocks = 1 + max(b for _, _, ids in seqs for b in ids)
    cache = torch.randn(2, blocks, BS, Hkv, D, generator=g).to(dtype)
    slots, qsl, lens, tables = [], [0], [], []
    width = max(len(ids) for _, _, ids in seqs)
    for length, new, ids in seqs:
        slots += [ids[p // BS] * BS + p % BS for p in range(length - new, length)]
        qsl.append(qsl[-1] + new)
        lens.append(length)
        tables.append(ids + [0] * (width - len(ids)))
    T = qsl[-1]
    q = torch.randn(T, Hq, D, generator=g).to(dtype)
    k = torch.randn(T, Hkv, D, generator=g).to(dtype)
    v = torch.randn(T, Hkv, D, generator=g).to(dtype)
    meta = AttentionMetadata(torch.tensor(slots), qsl, lens, torch.tensor(tables))
    return q, k, v, cache, meta


def _attend(seqs, Hq, Hkv, dtype, window=None, batched=True, monkeypatch=None):
    q, k, v, cache, meta = _step(seqs, Hq, Hkv, 64, dtype)
    if not batched:
        monkeypatch.setattr(_ChunkBatch, "MAX_PADDED_WORK", 0.0)
        monkeypatch.setattr(_ChunkBatch, "SMALL_PADDED_WORK", 0)
    with ops.disabled():
        plan = meta.plan(BS, torch.device("cpu"), window, dtype)
        out = paged_attention(q, k, v, cache, meta, window=window)
    monkeypatch.undo()
    return out, plan


PREFIX = list(range(6))  # six shared blocks: 96 tokens, past CASCADE_MIN_TOKENS
CASES = {
    # three chunks behind their own cached contexts, a decode and a fresh prompt: no cascade
    "own contexts": [
        (70, 20, [0, 1, 2, 3, 4]),
        (40, 7, [5, 6, 7]),
        (55, 33, [8, 9, 10, 11]),
        (30, 1, [12, 13]),
        (12, 12, [14]),
    ],
    # three chunks and two decodes on one shared 96-token prefix: the cascade, then each suffix
    "shared prefix": [
        (96 + 20, 20, PREFIX + [6, 7]),
        (96 + 9, 5, PREFIX + [8]),
        (96 + 31, 31, PREFIX + [9, 10]),
        (96 + 40, 1, PREFIX + [11, 12, 13]),
        (96 + 3, 1, PREFIX + [14]),
    ],
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("Hq, Hkv", [(4, 4), (9, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_padded_attention_equals_one_per_chunk(case, Hq, Hkv, dtype, monkeypatch):
    batched, plan = _attend(CASES[case], Hq, Hkv, dtype, monkeypatch=monkeypatch)
    assert plan.chunk_batch is not None and not plan.chunked
    assert (plan.prefix_slots is not None) == (case == "shared prefix")
    alone, plan = _attend(CASES[case], Hq, Hkv, dtype, batched=False, monkeypatch=monkeypatch)
    assert plan.chunk_batch is None and len(plan.chunked) == 3
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(batched, alone, atol=tol, rtol=tol)


def test_a_sliding_window_masks_the_padded_batch_alike(monkeypatch):
    seqs = [(90, 30, [0, 1, 2, 3, 4, 5]), (70, 9, [6, 7, 8, 9, 10]), (50, 50, [11, 12, 13, 14])]
    batched, plan = _attend(seqs, 9, 3, torch.float32, window=24, monkeypatch=monkeypatch)
    assert plan.chunk_batch is not None
    alone, _ = _attend(seqs, 9, 3, torch.float32, window=24, batched=False, monkeypatch=monkeypatch)
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-5)


def test_padding_that_would_more_than_double_the_work_runs_chunk_by_chunk(monkeypatch):
    # one long chunk behind a long context beside short ones: padding them all to it is waste
    seqs = [(2000, 1500, list(range(125))), (40, 3, [125, 126, 127]), (20, 2, [128, 129])]
    _, plan = _attend(seqs, 4, 4, torch.float32, monkeypatch=monkeypatch)
    assert plan.chunk_batch is None and len(plan.chunked) == 3
