"""The Triton paged-attention kernels (model/kernels/triton_attention.py) against the explicit
softmax over the gathered context: ragged lengths crossing block boundaries, GQA, a sliding window,
a start past a shared prefix, padding rows, split contexts; float32 to rounding, bfloat16 and
float16 close. On CPU under Triton's interpreter (tests/model/triton_interpreter.py), compiled on a
GPU; and compiled for an H100 without one (tests/model/triton_compile.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from .triton_interpreter import device, kernels_module


@pytest.fixture(scope="module")
def ta() -> ModuleType:
    return kernels_module()


def _cache(num_blocks: int, block_size: int, hkv: int, d: int, dtype: torch.dtype, gen: torch.Generator):
    kv = torch.randn(2, num_blocks, block_size, hkv, d, generator=gen).to(dtype).to(device())
    return kv[0], kv[1]


def _tables(seq_lens: list[int], block_size: int, max_blocks: int, num_blocks: int, gen: torch.Generator):
    """Each sequence's blocks drawn at random from the pool (distinct within the batch), so a
    context's neighbouring positions sit in unrelated blocks; unused columns hold -1 (never read)."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    rows = []
    for s in seq_lens:
        n = -(-s // block_size)
        rows.append(perm[:n] + [-1] * (max_blocks - n))
        perm = perm[n:]
    return torch.tensor(rows, dtype=torch.int32, device=device())


def _reference(q, k_cache, v_cache, table, seq_len, qpos, scale, window=None, start=0, softcap=None):
    """Rows q [M, Hq, D] at positions qpos [M] against the keys they see, float64: (o, lse); scores
    soft-capped first where `softcap` is given."""
    block_size, hkv, d = k_cache.shape[1:]
    M, hq, _ = q.shape
    pos = torch.arange(seq_len, device=q.device)
    qpos = qpos.to(q.device)
    slots = table.long()[pos // block_size] * block_size + pos % block_size if seq_len else pos
    k = k_cache.reshape(-1, hkv, d)[slots].double().repeat_interleave(hq // hkv, 1)  # [L, Hq, D]
    v = v_cache.reshape(-1, hkv, d)[slots].double().repeat_interleave(hq // hkv, 1)
    scores = torch.einsum("mhd,lhd->hml", q.double(), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    seen = (pos[None, :] <= qpos[:, None]) & (pos[None, :] >= start)
    if window is not None:
        seen &= qpos[:, None] - pos[None, :] < window
    scores = scores.masked_fill(~seen[None], float("-inf"))
    lse = torch.logsumexp(scores, -1)  # [Hq, M]
    o = torch.einsum("hml,lhd->mhd", torch.exp(scores - lse[..., None]).nan_to_num(0.0), v)
    return o, lse.T


TOL = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (3e-2, 3e-2), torch.float16: (4e-3, 4e-3)}


@pytest.mark.parametrize(
    "dtype,hq,hkv,seq_lens,window,start,splits",
    [
        (torch.float32, 4, 2, [1, 17, 40], None, 0, 1),  # GQA, lengths across blocks
        (torch.float32, 2, 2, [33, 0, 5], None, 0, 3),  # a padding row; a split context
        (torch.float32, 4, 1, [45, 9], 12, 0, 2),  # a window, split
        (torch.float32, 4, 2, [40, 37], None, 32, 1),  # keys from a shared prefix's end on
        (torch.bfloat16, 4, 2, [30, 7, 0], None, 0, 2),
        (torch.float16, 4, 2, [30, 7], 10, 0, 1),
        (torch.float32, 6, 2, [30, 7], None, 0, 2),  # groups of 3 heads (padded)
    ],
)
def test_decode_matches_reference(ta: ModuleType, dtype, hq, hkv, seq_lens, window, start, splits):
    gen = torch.Generator().manual_seed(len(seq_lens) * 100 + hq + splits)
    block_size, d, num_blocks, max_blocks = 8, 16, 24, 7
    k_cache, v_cache = _cache(num_blocks, block_size, hkv, d, dtype, gen)
    tables = _tables(seq_lens, block_size, max_blocks, num_blocks, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device())
    q = torch.randn(len(seq_lens), hq, d, generator=gen).to(dtype).to(device())
    lse = torch.full((len(seq_lens), hq), 7.0, device=device())
    out = torch.full_like(q, 7.0)  # written everywhere, padding rows included
    got = ta.paged_decode(
        q, k_cache, v_cache, tables, lens, 0.25, window=window, start=start, out=out, lse=lse, num_splits=splits
    )
    assert got is out
    atol, rtol = TOL[dtype]
    for i, s in enumerate(seq_lens):
        if s == 0:
            assert (got[i] == 0).all() and (lse[i] == float("-inf")).all()
            continue
        qpos = torch.tensor([s - 1])
        o, ref_lse = _reference(q[i : i + 1], k_cache, v_cache, tables[i], s, qpos, 0.25, window, start)
        torch.testing.assert_close(got[i].double(), o[0], atol=atol, rtol=rtol)
        torch.testing.assert_close(lse[i].double(), ref_lse[0], atol=1e-4, rtol=1e-4)


def test_decode_without_lse_and_splits_agree(ta: ModuleType):
    """Split or not, the same results to rounding; the default split count is a function of the
    launch's static shapes (1 off a GPU)."""
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = _cache(20, 8, 2, 16, torch.float32, gen)
    seq_lens = [70, 3, 51]
    tables = _tables(seq_lens, 8, 9, 20, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device())
    q = torch.randn(3, 4, 16, generator=gen).to(device())
    one = ta.paged_decode(q, k_cache, v_cache, tables, lens, 0.3)
    four = ta.paged_decode(q, k_cache, v_cache, tables, lens, 0.3, num_splits=4)
    torch.testing.assert_close(one, four, atol=2e-6, rtol=1e-5)
    assert ta.decode_splits(3, 2, 72, torch.device("cpu")) == 1


@pytest.mark.parametrize(
    "dtype,hq,hkv,chunks,window,start",
    [
        # (new tokens, total keys) per sequence: after cached context, a fresh prompt, a decode row
        (torch.float32, 4, 2, [(5, 21), (19, 19), (1, 30)], None, 0),
        (torch.float32, 2, 1, [(20, 44), (3, 11)], 9, 0),
        (torch.float32, 4, 2, [(6, 38), (4, 36)], None, 32),
        (torch.bfloat16, 4, 2, [(18, 40), (2, 9)], None, 0),
        (torch.float16, 4, 4, [(7, 25)], 6, 0),
        (torch.float32, 6, 2, [(9, 30), (3, 3), (17, 17)], None, 0),  # groups of 3 heads (padded to 4)
    ],
)
def test_prefill_matches_reference(ta: ModuleType, dtype, hq, hkv, chunks, window, start):
    gen = torch.Generator().manual_seed(sum(n for n, _ in chunks) + hq)
    block_size, d, num_blocks, max_blocks = 8, 16, 28, 6
    k_cache, v_cache = _cache(num_blocks, block_size, hkv, d, dtype, gen)
    seq_lens = [s for _, s in chunks]
    tables = _tables(seq_lens, block_size, max_blocks, num_blocks, gen)
    # the sequences' rows out of order in the step, with a row of another kind before each
    starts, row = [], 0
    for n, _ in reversed(chunks):
        starts.append(row + 1)
        row += n + 1
    starts.reverse()
    T = row
    q = torch.randn(T, hq, d, generator=gen).to(dtype).to(device())
    out = torch.full_like(q, 7.0)
    lse = torch.full((T, hq), 7.0, device=device())

    def ints(values):
        return torch.tensor(values, dtype=torch.int32, device=device())

    news = [n for n, _ in chunks]
    ta.paged_prefill(
        q, k_cache, v_cache, tables, ints(starts), ints(news), ints(seq_lens), max(news), 0.25, out,
        window=window, start=start, lse=lse,
    )  # fmt: skip
    atol, rtol = TOL[dtype]
    written = torch.zeros(T, dtype=torch.bool, device=device())
    for c, (n, s) in enumerate(chunks):
        rows = slice(starts[c], starts[c] + n)
        written[rows] = True
        o, ref_lse = _reference(q[rows], k_cache, v_cache, tables[c], s, torch.arange(s - n, s), 0.25, window, start)
        torch.testing.assert_close(out[rows].double(), o, atol=atol, rtol=rtol)
        torch.testing.assert_close(lse[rows].double(), ref_lse, atol=1e-4, rtol=1e-4)
    assert (out[~written] == 7.0).all() and (lse[~written] == 7.0).all()  # other rows untouched


@pytest.mark.parametrize(
    "dtype,hq,hkv,chunks,window",
    [
        # (new tokens, total keys): a chunk after cached context, a fresh prompt, two decodes
        (torch.float32, 4, 2, [(5, 21), (19, 19), (1, 30), (1, 1)], None),
        (torch.float32, 6, 2, [(20, 44), (1, 12), (3, 11)], 9),  # groups of 3 heads, a window
        (torch.bfloat16, 4, 2, [(18, 40), (1, 9)], None),
    ],
)
def test_prefill_over_a_tile_map_matches_reference(ta: ModuleType, dtype, hq, hkv, chunks, window):
    """The fixed-grid launch a captured mixed step makes: every sequence's rows as the reference
    computes them; padding rows past the step's tokens, and sequences the map does not name,
    untouched; columns naming the padding sequence (no tokens) do nothing."""
    from prefixkv.engine.mixed_host_inputs import tile_map

    gen = torch.Generator().manual_seed(sum(n for n, _ in chunks) + hq)
    block_size, d, num_blocks, max_blocks = 8, 16, 28, 6
    k_cache, v_cache = _cache(num_blocks, block_size, hkv, d, dtype, gen)
    seq_lens = [s for _, s in chunks]
    news = [n for n, _ in chunks]
    tables = _tables(seq_lens, block_size, max_blocks, num_blocks, gen)
    # buffers of 6 sequences: the step's, a stale one the map never names, then the padding one
    C, pad = len(chunks), 5
    padded_tables = torch.zeros(pad + 1, max_blocks, dtype=torch.int32, device=device())
    padded_tables[:C] = tables
    starts = [sum(news[:c]) for c in range(C)]
    T = sum(news) + 7  # seven padding rows
    seqs = torch.zeros(3, pad + 1, dtype=torch.int32)
    seqs[:, :C] = torch.tensor([starts, news, seq_lens])
    seqs[:, C] = torch.tensor([0, 4, 4])  # a stale entry: not in the map, so never read
    q_start, q_len, lens = seqs.to(device())
    on_gpu = device().type == "cuda"
    tile_tokens = ta.prefill_tile_tokens(dtype, on_gpu, hq // hkv)
    tiles = T // tile_tokens + pad
    mapping = torch.from_numpy(tile_map(news, tile_tokens, tiles, pad)).to(device())
    q = torch.randn(T, hq, d, generator=gen).to(dtype).to(device())
    out = torch.full_like(q, 7.0)
    ta.paged_prefill_tiles(
        q, k_cache, v_cache, padded_tables, q_start, q_len, lens, mapping, tile_tokens, 0.25, out, window=window
    )
    atol, rtol = TOL[dtype]
    for c, (n, s) in enumerate(chunks):
        rows = slice(starts[c], starts[c] + n)
        o, _ = _reference(q[rows], k_cache, v_cache, tables[c], s, torch.arange(s - n, s), 0.25, window)
        torch.testing.assert_close(out[rows].double(), o, atol=atol, rtol=rtol)
    assert (out[sum(news) :] == 7.0).all()  # padding rows untouched
    with pytest.raises(ValueError, match="tiles of"):
        ta.paged_prefill_tiles(
            q, k_cache, v_cache, padded_tables, q_start, q_len, lens, mapping, tile_tokens * 2, 0.25, out
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_capped_scores_match_reference(ta: ModuleType, dtype):
    """Gemma 2's cap (cap * tanh(score / cap) before the softmax) in the decode kernel, split and
    not, and in the tile-mapped prefill kernel: scores large enough for the cap to bite."""
    from prefixkv.engine.mixed_host_inputs import tile_map

    gen = torch.Generator().manual_seed(9)
    block_size, hq, hkv, d, cap = 8, 4, 2, 16, 3.0
    k_cache, v_cache = _cache(20, block_size, hkv, d, dtype, gen)
    seq_lens = [37, 9]
    tables = _tables(seq_lens, block_size, 6, 20, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device())
    q = (4 * torch.randn(2, hq, d, generator=gen)).to(dtype).to(device())
    atol, rtol = TOL[dtype]
    for splits in (1, 3):
        o = ta.paged_decode(q, k_cache, v_cache, tables, lens, 0.5, num_splits=splits, softcap=cap)
        for b, s in enumerate(seq_lens):
            want, _ = _reference(q[b : b + 1], k_cache, v_cache, tables[b], s, torch.tensor([s - 1]), 0.5, softcap=cap)
            torch.testing.assert_close(o[b : b + 1].double(), want, atol=atol, rtol=rtol)
        uncapped = ta.paged_decode(q, k_cache, v_cache, tables, lens, 0.5, num_splits=splits)
        assert not torch.allclose(o.float(), uncapped.float(), atol=1e-2)  # the cap bites
    news = [5, 1]
    T = sum(news)
    qp = (4 * torch.randn(T, hq, d, generator=gen)).to(dtype).to(device())
    seqs = torch.tensor([[0, 5, 0], [5, 1, 0], [37, 9, 0]], dtype=torch.int32).to(device())
    tile_tokens = ta.prefill_tile_tokens(dtype, device().type == "cuda", hq // hkv)
    padded_tables = torch.cat([tables, torch.zeros(1, 6, dtype=torch.int32, device=device())])
    mapping = torch.from_numpy(tile_map(news, tile_tokens, T // tile_tokens + 2, 2)).to(device())
    out = torch.zeros_like(qp)
    ta.paged_prefill_tiles(
        qp, k_cache, v_cache, padded_tables, seqs[0], seqs[1], seqs[2], mapping, tile_tokens, 0.5, out, softcap=cap
    )
    for c, (a, n, s) in enumerate([(0, 5, 37), (5, 1, 9)]):
        want, _ = _reference(qp[a : a + n], k_cache, v_cache, tables[c], s, torch.arange(s - n, s), 0.5, softcap=cap)
        torch.testing.assert_close(out[a : a + n].double(), want, atol=atol, rtol=rtol)


@pytest.mark.slow
def test_kernels_compile_for_hopper(tmp_path):
    """Triton's compiler takes every kernel variant the entry points launch down to an H100's
    machine code, here without a GPU (in a process of its own: this one may run the interpreter)."""
    pytest.importorskip("triton.backends.nvidia")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=os.pathsep.join([str(root), env.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-m", "tests.model.triton_compile", "90"], cwd=root, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("sm_90 ") == 30, done.stdout


@pytest.mark.parametrize(
    "case",
    ["cascade", "mixed", "window"],
)
def test_paged_attention_paths_agree(ta: ModuleType, monkeypatch, case):
    """model/attention.paged_attention with the Triton path against the device's own (CPU: the
    native kernels and the gather), on one step mixing a fresh prompt, chunks after cached context
    and decodes; 'cascade': every reader shares 9 leading blocks, attended to once and merged."""
    from prefixkv.model.attention import AttentionMetadata, paged_attention
    from prefixkv.model.attention_path import ENV

    gen = torch.Generator().manual_seed(len(case))
    bs, hq, hkv, d, num_blocks = 8, 4, 2, 16, 64
    # (total keys, new tokens) per sequence
    seqs = [(80, 1), (90, 10), (75, 1), (12, 12)] + ([] if case == "cascade" else [(30, 6)])
    window = 20 if case == "window" else None
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    shared, perm = perm[:9], perm[9:]
    tables = []
    for i, (s, _) in enumerate(seqs):
        n = -(-s // bs)
        own = shared[:n] if i < 3 else []
        tables.append(own + perm[: n - len(own)])
        perm = perm[n - len(own) :]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device())
    slots = torch.cat(
        [torch.tensor([tables[i][p // bs] * bs + p % bs for p in range(s - n, s)]) for i, (s, n) in enumerate(seqs)]
    )
    qsl = [0]
    for _, n in seqs:
        qsl.append(qsl[-1] + n)
    T = qsl[-1]
    cache = torch.randn(2, num_blocks, bs, hkv, d, generator=gen).to(device())
    q, k, v = (torch.randn(T, h, d, generator=gen).to(device()) for h in (hq, hkv, hkv))
    outs = {}
    for path in ("gather", "triton"):
        monkeypatch.setenv(ENV, path)
        meta = AttentionMetadata(slots.to(device()), qsl, [s for s, _ in seqs], bt)
        outs[path] = paged_attention(q, k, v, cache.clone(), meta, window=window)
        plan = meta.plan(bs, q.device, window, q.dtype)
        assert plan.triton == (path == "triton")
        assert (plan.prefix_tokens == 72) == (case == "cascade")
    torch.testing.assert_close(outs["triton"], outs["gather"], atol=2e-5, rtol=1e-5)
