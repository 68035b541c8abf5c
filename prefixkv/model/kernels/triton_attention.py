"""Paged attention in Triton that reads K/V through the block tables in place (no gathered copy of
the context): a decode kernel (one query a sequence, split over the context as flash-decoding
does) and a prefill kernel for new tokens after cached context (causal among themselves).

Both read one layer's cache as ``k_cache``, ``v_cache`` of ``[num_blocks, block_size, Hkv, D]``
(``kv_cache[0]``, ``kv_cache[1]``), a token at ``block_tables[seq, pos // block_size]`` and
``pos % block_size``. Every sequence reads keys from ``start`` on (the cascade's shared prefix is
attended to elsewhere), or from where its sliding ``window`` begins. Scores, softmax and sums are
float32 whatever the cache's dtype; float32 products run at IEEE precision (no TF32), so float32
results match the PyTorch path's to rounding. Launch shapes depend only on the batch size, the
block tables' width and the model's shapes, never on the lengths, so a decode step can be captured
in a CUDA graph.

Under ``TRITON_INTERPRET=1`` (read when this module is imported) the kernels run on CPU tensors,
which is how the CPU tests check them.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

# Keys a context split reads at the least: below this the partial results' write and reduce cost
# more than the parallelism they buy.
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 32


@triton.jit
def _paged_tile(head_ptr, blk, off, stride_b, stride_s, offs_d, mask, DOT_DTYPE: tl.constexpr):
    """A tile of one KV head's keys or values read in place: row i at offset off[i] of block
    blk[i] of the paged cache (`head_ptr`: the cache's first element of that head)."""
    at = head_ptr + blk[:, None] * stride_b + off[:, None] * stride_s + offs_d[None, :]
    return tl.load(at, mask=mask, other=0.0).to(DOT_DTYPE)


@triton.jit
def _capped(s, cap):
    """cap * tanh(s / cap) (Gemma 2's soft cap), from exp(-2|x|) so that no large |x| overflows."""
    e = tl.exp(-2.0 * tl.abs(s) / cap)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(s < 0, -t, t) * cap


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    seq_lens_ptr,
    o_ptr,
    lse_ptr,
    scale,
    start,
    window,
    softcap,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_btb,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_ls,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_LSE: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """One program per (sequence, KV head, context split): the G query heads of that KV head
    against the split's keys. Writes o (normalised) and lse per split (or the final ones when
    NUM_SPLITS is 1); a split without keys writes o = 0, lse = -inf."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_ok = offs_g < G
    d_ok = offs_d < D
    heads = kvh * G + offs_g
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    lo = start
    if HAS_WINDOW:
        lo = tl.maximum(lo, seq_len - window)
    n_keys = tl.maximum(seq_len - lo, 0)
    # whole tiles a split (integer arithmetic, not tl.cdiv: the interpreter runs only builtins)
    per_split = ((n_keys + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    s_lo = lo + split * per_split
    s_hi = tl.minimum(s_lo + per_split, seq_len)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(s_lo, s_hi, BLOCK_N):
        pos = n0 + offs_n
        ok = pos < s_hi
        blk = tl.load(bt_ptr + b * stride_btb + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        off = pos % BLOCK_SIZE
        kv_ok = ok[:, None] & d_ok[None, :]
        k = _paged_tile(k_ptr + kvh * stride_kh, blk, off, stride_kb, stride_ks, offs_d, kv_ok, DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_G, BLOCK_N], float32
        if HAS_SOFTCAP:
            s = _capped(s, softcap)
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _paged_tile(v_ptr + kvh * stride_vh, blk, off, stride_vb, stride_vs, offs_d, kv_ok, DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
        m_i = m_new
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(
        o_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :],
        o,
        mask=g_ok[:, None] & d_ok[None, :],
    )
    if HAS_LSE:
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split * stride_ls, lse, mask=g_ok)


@triton.jit
def _reduce_kernel(
    part_o_ptr,
    part_lse_ptr,
    o_ptr,
    lse_ptr,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lpb,
    stride_lph,
    stride_ob,
    stride_oh,
    stride_lb,
    stride_lh,
    NUM_SPLITS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_LSE: tl.constexpr,
):
    """The splits of one (sequence, query head) merged by their log-sum-exp."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    lse_s = tl.load(part_lse_ptr + b * stride_lpb + h * stride_lph + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_safe)  # 0 for empty splits
    total = tl.sum(w, 0)
    po = tl.load(
        part_o_ptr + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=s_ok[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )
    o = tl.sum(po * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_d, o, mask=offs_d < D)
    if HAS_LSE:
        lse = tl.where(total > 0, m_safe + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
        tl.store(lse_ptr + b * stride_lb + h * stride_lh, lse)


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    q_start_ptr,
    q_len_ptr,
    seq_lens_ptr,
    tile_map_ptr,
    o_ptr,
    lse_ptr,
    scale,
    start,
    window,
    softcap,
    stride_map,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_btb,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_LSE: tl.constexpr,
    TILE_MAP: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """One program per (tile of BLOCK_M new tokens, sequence, KV head): the tile's tokens times
    the KV head's G query heads as the rows of one product (each key tile read once for all G),
    against the sequence's context and the new tokens up to each (causal). Tiles past a sequence's
    new tokens read and write nothing. With TILE_MAP the grid is (tiles, 1, KV heads) and program
    i's sequence and tile are tile_map[0, i] and tile_map[1, i]: a fixed grid whatever the step's
    lengths (what a CUDA graph replays)."""
    if TILE_MAP:
        c = tl.load(tile_map_ptr + tl.program_id(0))
        tile = tl.load(tile_map_ptr + stride_map + tl.program_id(0))
    else:
        tile = tl.program_id(0)
        c = tl.program_id(1)
    kvh = tl.program_id(2)
    n_new = tl.load(q_len_ptr + c)
    row0 = tl.load(q_start_ptr + c)
    seq_len = tl.load(seq_lens_ptr + c)
    offs_r = tl.arange(0, BLOCK_M * BLOCK_G)
    tok = tile * BLOCK_M + offs_r // BLOCK_G  # row r: token r // BLOCK_G, head r % BLOCK_G of the group
    heads = kvh * G + offs_r % BLOCK_G
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    m_ok = (tok < n_new) & (offs_r % BLOCK_G < G)
    rows = (row0 + tok).to(tl.int64)
    qpos = seq_len - n_new + tok  # each query's position in its sequence
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=m_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    first_q = seq_len - n_new + tile * BLOCK_M
    lo = start
    if HAS_WINDOW:
        lo = tl.maximum(lo, first_q - window + 1)
    hi = tl.minimum(seq_len, first_q + BLOCK_M)  # the tile's last query sees keys up to itself
    hi = tl.where(tile * BLOCK_M < n_new, hi, lo)  # a tile past the new tokens: no keys
    m_i = tl.full([BLOCK_M * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + offs_n
        ok = pos < hi
        blk = tl.load(bt_ptr + c * stride_btb + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        off = pos % BLOCK_SIZE
        kv_ok = ok[:, None] & d_ok[None, :]
        k = _paged_tile(k_ptr + kvh * stride_kh, blk, off, stride_kb, stride_ks, offs_d, kv_ok, DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_M * BLOCK_G, BLOCK_N]
        if HAS_SOFTCAP:
            s = _capped(s, softcap)
        visible = ok[None, :] & (pos[None, :] <= qpos[:, None])
        if HAS_WINDOW:
            visible = visible & (qpos[:, None] - pos[None, :] < window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row seeing no key of this tile yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _paged_tile(v_ptr + kvh * stride_vh, blk, off, stride_vb, stride_vs, offs_d, kv_ok, DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
        m_i = m_new
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    o_at = o_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_at, o, mask=m_ok[:, None] & d_ok[None, :])
    if HAS_LSE:
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + rows * stride_lt + heads * stride_lh, lse, mask=m_ok)


def _pow2(n: int, least: int = 16) -> int:
    """Block extents: powers of two (tl.arange) and at least 16 (tl.dot's smallest tile)."""
    return max(least, int(triton.next_power_of_2(n)))


_DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _products(dtype: torch.dtype, on_gpu: bool) -> dict[str, Any]:
    """What the products take: q's dtype on a GPU (float32 accumulation either way), float32 off
    one, where Triton's interpreter multiplies bfloat16 blocks wrongly (their raw bits); float32
    products at IEEE precision (not TF32's 10-bit mantissa)."""
    if dtype not in _DOT_DTYPES:
        raise ValueError(f"no Triton attention for {dtype}: float32, bfloat16 or float16")
    dot = _DOT_DTYPES[dtype] if on_gpu else tl.float32
    return dict(DOT_DTYPE=dot, PRECISION="ieee" if dot == tl.float32 else "tf32")


# Launch options on a GPU: 8 warps keep a 128-wide head's tiles out of local memory (ptxas spilled
# them at 4, tests/model/triton_compile.py); 2 stages of K/V tiles in flight.
LAUNCH = dict(num_warps=8, num_stages=2)


def decode_constants(
    dtype: torch.dtype,
    on_gpu: bool,
    group: int,
    head_dim: int,
    block_size: int,
    splits: int,
    window: bool,
    lse: bool,
    softcap: bool = False,
) -> dict[str, Any]:
    """The decode kernel's compile-time arguments and launch options (tiles of 64 keys on a GPU, 32
    in float32 there - its IEEE products take twice the registers - and 16 under the interpreter)."""
    keys = (32 if dtype == torch.float32 else 64) if on_gpu else 16
    return dict(
        G=group,
        D=head_dim,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=splits,
        BLOCK_G=_pow2(group),
        BLOCK_N=keys,
        BLOCK_D=_pow2(head_dim),
        HAS_WINDOW=window,
        HAS_SOFTCAP=softcap,
        HAS_LSE=lse or splits > 1,
        **_products(dtype, on_gpu),
        **LAUNCH,
    )


def prefill_constants(
    dtype: torch.dtype,
    on_gpu: bool,
    group: int,
    head_dim: int,
    block_size: int,
    max_new: int,
    window: bool,
    lse: bool,
    softcap: bool = False,
) -> dict[str, Any]:
    """The prefill kernel's compile-time arguments and launch options: tiles of 64 query rows (a
    tile's tokens times the group's heads) x 64 keys on a GPU, 32 x 32 in float32; 32 rows x 16 keys
    under the interpreter; no more tokens a tile than the longest chunk's, no fewer than 16 rows."""
    tile = (32 if dtype == torch.float32 else 64) if on_gpu else 16
    heads = _pow2(group, 1)
    rows = max(tile, 32)
    tokens = max(min(rows // heads, _pow2(max_new, 1)), -(-16 // heads))
    return dict(
        TILE_MAP=False,
        G=group,
        D=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=tokens,
        BLOCK_G=heads,
        BLOCK_N=tile,
        BLOCK_D=_pow2(head_dim),
        HAS_WINDOW=window,
        HAS_SOFTCAP=softcap,
        HAS_LSE=lse,
        **_products(dtype, on_gpu),
        **LAUNCH,
    )


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must be [num_blocks, block_size, Hkv, D], got {tuple(k_cache.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous last (head_dim) axis")
    _, block_size, hkv, d = k_cache.shape
    hq = q.shape[1]
    if q.shape[-1] != d or hq % hkv:
        raise ValueError(f"q has {hq} heads of {q.shape[-1]}: not a multiple of {hkv} KV heads of {d}")
    return block_size, hkv, hq // hkv


@functools.cache
def _multiprocessors(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def decode_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """How many splits the context of each (sequence, KV head) is read in: enough programs to fill
    the GPU's multiprocessors twice, none reading fewer than MIN_KEYS_PER_SPLIT keys. A function of
    the launch's static shapes only (batch, heads, block tables' width), never of the lengths."""
    if device.type != "cuda":
        return 1
    sms = _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    wanted = -(-2 * sms // (batch * num_kv_heads))
    return max(1, min(wanted, -(-max_context // MIN_KEYS_PER_SPLIT), MAX_SPLITS))


def decode_workspace(
    batch: int, num_heads: int, head_dim: int, splits: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The split decode's partial outputs [B, Hq, splits, D] and log-sum-exps [B, Hq, splits]."""
    part_o = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=device)
    return part_o, torch.empty(batch, num_heads, splits, dtype=torch.float32, device=device)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
    start: int = 0,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    num_splits: int | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of one new query a sequence over its context, read in place.

    q [B, Hq, D]; block_tables int32 [B, max_blocks]; seq_lens int32 [B], each sequence's keys
    (its new token's included, already written to the cache); a row with seq_len 0 is padding and
    gets zeros (lse -inf). Keys from `start` on, or from seq_len - `window` on with a window.
    Writes into `out` ([B, Hq, D], q's dtype) if given, and the log-sum-exp into `lse` ([B, Hq],
    float32) if given. `num_splits` (default: decode_splits) splits each context as flash-decoding
    does, partial results merged by a second kernel, in `workspace` if given (decode_workspace's),
    else in buffers allocated here. `softcap`: scores become softcap * tanh(score / softcap) before
    the softmax (Gemma 2).
    """
    block_size, hkv, g = _check_cache(q, k_cache, v_cache)
    B, Hq, D = q.shape
    if out is None:
        out = torch.empty_like(q)
    splits = num_splits or decode_splits(B, hkv, block_tables.shape[1] * block_size, q.device)
    if B == 0:
        return out
    on_gpu = q.device.type == "cuda"
    common = decode_constants(
        q.dtype, on_gpu, g, D, block_size, splits, window is not None, lse is not None, softcap is not None
    )
    args = (
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
    )
    cache_strides = (*k_cache.stride()[:3], *v_cache.stride()[:3])
    head = (scale, start, window or 0, softcap or 1.0, q.stride(0), q.stride(1), *cache_strides, block_tables.stride(0))
    if splits == 1:
        lse_out = lse if lse is not None else out  # not written without HAS_LSE
        _decode_kernel[(B, hkv, 1)](
            *args,
            out,
            lse_out,
            *head,
            out.stride(0),
            out.stride(1),
            0,
            lse_out.stride(0),
            lse_out.stride(1),
            0,
            **common,
        )
        return out
    part_o, part_lse = workspace if workspace is not None else decode_workspace(B, Hq, D, splits, q.device)
    _decode_kernel[(B, hkv, splits)](
        *args,
        part_o,
        part_lse,
        *head,
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        part_lse.stride(2),
        **common,
    )
    lse_arg = lse if lse is not None else part_lse  # not written without HAS_LSE
    _reduce_kernel[(B, Hq)](
        part_o,
        part_lse,
        out,
        lse_arg,
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        lse_arg.stride(0),
        lse_arg.stride(1),
        NUM_SPLITS=splits,
        D=D,
        BLOCK_S=_pow2(splits, 1),
        BLOCK_D=_pow2(D),
        HAS_LSE=lse is not None,
    )
    return out


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    seq_lens: torch.Tensor,
    max_new: int,
    scale: float,
    out: torch.Tensor,
    *,
    window: int | None = None,
    start: int = 0,
    lse: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of several sequences' new tokens over their context and each other, read in place.

    q [T, Hq, D], the step's rows; sequence c's new tokens are rows q_start[c] .. + q_len[c] (int32
    [C] each), the last q_len[c] of its seq_lens[c] keys (already written to the cache), read
    through block_tables[c] (int32 [C, max_blocks]); `max_new` bounds q_len. Causal, from `start`
    on, with a sliding `window` if given. Writes those rows of `out` ([T, Hq, D]) and of `lse`
    ([T, Hq], float32) if given; other rows are left alone. `softcap`: as `paged_decode`'s.
    """
    block_size, hkv, g = _check_cache(q, k_cache, v_cache)
    C, D = q_len.shape[0], q.shape[2]
    if C == 0 or max_new == 0:
        return out
    constants = prefill_constants(
        q.dtype, q.device.type == "cuda", g, D, block_size, max_new, window is not None, lse is not None,
        softcap is not None,
    )  # fmt: skip
    lse_arg = lse if lse is not None else out  # not written without HAS_LSE
    _prefill_kernel[(-(-max_new // constants["BLOCK_M"]), C, hkv)](
        q,
        k_cache,
        v_cache,
        block_tables,
        q_start,
        q_len,
        seq_lens,
        q_len,  # no tile map
        out,
        lse_arg,
        scale,
        start,
        window or 0,
        softcap or 1.0,
        0,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        lse_arg.stride(0),
        lse_arg.stride(1),
        **constants,
    )
    return out


def prefill_tile_tokens(dtype: torch.dtype, on_gpu: bool, group: int) -> int:
    """The tokens a tile of `paged_prefill_tiles` holds (`prefill_constants`' largest for this
    group): what a step's tile map is built with."""
    return int(prefill_constants(dtype, on_gpu, group, 16, 16, 1 << 30, False, False)["BLOCK_M"])


def paged_prefill_tiles(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    seq_lens: torch.Tensor,
    tile_map: torch.Tensor,
    tile_tokens: int,
    scale: float,
    out: torch.Tensor,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """`paged_prefill` over a fixed grid: one program per column of `tile_map` (int32 [2, tiles]:
    each tile's sequence, and its index among that sequence's tiles of `tile_tokens` tokens,
    `prefill_tile_tokens`') and KV head. A column naming a sequence of q_len 0, or a tile past its
    new tokens, does nothing. The launch depends on the tensors' shapes only, never on their
    values: a step of any mix of prompts, chunks and decodes can be captured once and replayed.
    Sequences of q_len 1 are decodes, a sequence whose q_len equals its seq_len a prompt without
    cached context. `softcap`: as `paged_decode`'s."""
    block_size, hkv, g = _check_cache(q, k_cache, v_cache)
    D = q.shape[2]
    if tile_map.dim() != 2 or tile_map.shape[0] != 2 or tile_map.stride(1) != 1:
        raise ValueError(f"tile_map must be a row-major int32 [2, tiles], got {tuple(tile_map.shape)}")
    on_gpu = q.device.type == "cuda"
    constants = prefill_constants(
        q.dtype, on_gpu, g, D, block_size, 1 << 30, window is not None, False, softcap is not None
    )
    if constants["BLOCK_M"] != tile_tokens:
        held = constants["BLOCK_M"]
        raise ValueError(f"the tile map was built for tiles of {tile_tokens} tokens; this kernel's hold {held}")
    constants["TILE_MAP"] = True
    _prefill_kernel[(tile_map.shape[1], 1, hkv)](
        q,
        k_cache,
        v_cache,
        block_tables,
        q_start,
        q_len,
        seq_lens,
        tile_map,
        out,
        out,  # no log-sum-exp
        scale,
        0,
        window or 0,
        softcap or 1.0,
        tile_map.stride(0),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        out.stride(0),
        out.stride(1),
        **constants,
    )
    return out
