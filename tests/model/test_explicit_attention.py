"""Soft-capped attention and attention with sinks, by chunks of queries
(model/explicit_attention.py), equal the explicit softmax of every query over its whole context
(transformers' order: scale, cap, mask, sink column, softmax, sink dropped),
through paged_attention: fresh prompts, chunks after cached context and decodes in one step, with
and without a sliding window, at lengths around the chunk edges and with the score budget
binding (fewer rows a chunk)."""

from __future__ import annotations

import pytest
import torch

from prefixkv.model import explicit_attention
from prefixkv.model.attention import AttentionMetadata, paged_attention

HQ, HKV, D, BS = 4, 2, 16, 4
SCALE, CAP = 0.3, 2.0


def dense(q, k, v, first, window, cap=CAP, sinks=None):
    """Rows of queries at positions first.. against keys 0..: float64, every score computed."""
    q, k, v = q.double(), k.double(), v.double()
    G = HQ // HKV
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * SCALE
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    qpos = first + torch.arange(q.shape[0])[:, None]
    kpos = torch.arange(k.shape[0])[None, :]
    hidden = kpos > qpos
    if window is not None:
        hidden |= qpos - kpos >= window
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        sink = sinks.double().view(HQ, 1, 1).expand(HQ, q.shape[0], 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v).float()


# each variant: (soft cap, sink logits per query head)
SINKS = torch.tensor([0.5, -1.0, 2.5, 0.0])
VARIANTS = {"softcap": (CAP, None), "sinks": (None, SINKS), "both": (CAP, SINKS)}


def run_steps(lengths, steps, window, dtype=torch.float32, variant="softcap"):
    """Sequences of `lengths` tokens fed `steps` tokens a step each (0: none that step); each
    step's outputs against the dense attention of the same rows. Blocks are handed out in
    reverse, so that no context lies in order in the cache."""
    torch.manual_seed(sum(lengths))
    seqs = [(torch.randn(n, HQ, D), torch.randn(n, HKV, D), torch.randn(n, HKV, D)) for n in lengths]
    per_seq = [-(-n // BS) for n in lengths]
    total = sum(per_seq)
    order = torch.arange(total).flip(0)
    tables = torch.zeros(len(lengths), max(per_seq), dtype=torch.long)
    at = 0
    for i, m in enumerate(per_seq):
        tables[i, :m] = order[at : at + m]
        at += m
    cache = torch.zeros(2, total, BS, HKV, D, dtype=dtype)
    done = [0] * len(lengths)
    for step in steps:
        qsl, rows, slots = [0], [], []
        for i, n_new in enumerate(step):
            a, b = done[i], done[i] + n_new
            rows.append((i, a, b))
            pos = torch.arange(a, b)
            slots.append(tables[i, pos // BS] * BS + pos % BS)
            qsl.append(qsl[-1] + n_new)
        seq_lens = [done[i] + n for i, n in enumerate(step)]
        meta = AttentionMetadata(torch.cat(slots), qsl, seq_lens, tables)
        q = torch.cat([seqs[i][0][a:b] for i, a, b in rows]).to(dtype)
        k = torch.cat([seqs[i][1][a:b] for i, a, b in rows]).to(dtype)
        v = torch.cat([seqs[i][2][a:b] for i, a, b in rows]).to(dtype)
        cap, sinks = VARIANTS[variant]
        out = paged_attention(q, k, v, cache, meta, scale=SCALE, window=window, softcap=cap, sinks=sinks)
        for (i, a, b), r0 in zip(rows, qsl):
            if b == a:
                continue
            sq, sk, sv = seqs[i]
            want = dense(sq[a:b].to(dtype), sk[:b].to(dtype), sv[:b].to(dtype), a, window, cap, sinks)
            tol = 1e-5 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(out[r0 : r0 + b - a].float(), want, atol=tol, rtol=tol)
        done = seq_lens


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(explicit_attention, "QUERY_CHUNK", 8)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("window", [None, 5, 12])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 16, 30])
def test_fresh_prompts(small_chunks, n, window, variant):
    run_steps([n, 3], [[n, 3]], window, variant=variant)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("window", [None, 6])
def test_chunks_after_cached_context_and_decodes(small_chunks, window, variant):
    # a prompt, then chunks (one longer than a query chunk) beside a fresh prompt, then decodes
    run_steps([40, 31, 12], [[9, 0, 0], [13, 20, 0], [1, 11, 12], [1, 0, 0], [1, 0, 0]], window, variant=variant)


def test_score_budget_takes_fewer_rows(monkeypatch):
    monkeypatch.setattr(explicit_attention, "QUERY_CHUNK", 64)
    monkeypatch.setattr(explicit_attention, "MAX_CHUNK_SCORES", HQ * 3 * 50)  # 3 rows at 50 keys
    run_steps([50, 20], [[20, 20], [30, 0]], None)
    run_steps([50, 20], [[20, 20], [30, 0]], 9)


@pytest.mark.parametrize("variant", ["softcap", "sinks"])
@pytest.mark.parametrize("window", [None, 10])
def test_bfloat16(small_chunks, window, variant):
    run_steps([37, 5], [[30, 5], [7, 0]], window, torch.bfloat16, variant)


def test_cap_and_window_change_the_output(small_chunks):
    """The reference can fail: without the cap, or with another window, other values."""
    torch.manual_seed(0)
    q, k, v = torch.randn(20, HQ, D) * 3, torch.randn(20, HKV, D) * 3, torch.randn(20, HKV, D)
    capped = dense(q, k, v, 0, 6)
    assert (capped - dense(q, k, v, 0, 7)).abs().max() > 0.1
    assert (capped - dense(q, k, v, 0, 6, cap=1e6)).abs().max() > 0.1
    assert (capped - dense(q, k, v, 0, 6, sinks=SINKS)).abs().max() > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sinks_on_the_native_prefill_kernel(monkeypatch, dtype):
    """Full layers with sinks, a step with a prompt or chunk: the native prefill kernel's output
    scaled by sigmoid(lse - sink) (a head size it takes), equal to the dense reference; a
    decode-only step keeps the explicit softmax."""
    import sys

    from prefixkv.model import attention
    from prefixkv.model.kernels import ops

    monkeypatch.setattr(sys.modules[__name__], "D", 32)
    calls, kernel = [], ops.prefill_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(attention.ops, "prefill_attention", counted)
    run_steps([40, 31, 12], [[9, 0, 0], [13, 20, 0], [1, 11, 12], [1, 0, 0]], None, dtype, "sinks")
    assert calls == [9, 33, 24]  # the three steps with more tokens than sequences, every row of each
