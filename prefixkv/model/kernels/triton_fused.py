"""A GPU's row-wise steps fused into one Triton kernel each: the residual add with the RMSNorm after
it, the rotary embedding of a layer's queries and keys (alone, or with the write of the new keys
and values into the paged KV cache), and SiLU-and-multiply. The same steps as the CPU's native
kernels (`ops.add_rms_norm`, `ops.rotary_`, `ops.write_kv`, `ops.silu_and_mul`), with their
semantics: PyTorch's formulation (kernels/reference.py) runs each as several kernels (a norm: a
float32 copy, the norm, a copy back, the weight's product, the residual add; the rotation four;
the cache write two; SiLU-and-multiply two).

Why: a decode step of a small model is hundreds of tiny kernels, and on a GPU each costs a few
microseconds whatever its size - inside a CUDA graph too. With these, a captured decode step of the
default model took 1.57 ms on an H100 at batch 1, against 2.31 ms with PyTorch's formulation
(bench/decode_graphs.py, docs/benchmarks.md).

Rounding follows the PyTorch formulation: every intermediate that PyTorch stores in the model's
dtype is rounded to it here too (the residual sum, the normalized row before the weight, each
product of the rotation, SiLU's result), and no multiply and add is fused into one (EXACT). A norm's
sum over the row may be taken in another order, and SiLU's exponential is Triton's, so results
match PyTorch's to rounding, not bit for bit. Every path of the engine on a GPU (eager, CUDA graphs,
cached or not) runs these same kernels, so they agree with each other bit for bit. Launch shapes
depend only on the tensors' shapes, so a CUDA graph can capture them.

Under ``TRITON_INTERPRET=1`` (read when this module is imported) they run on CPU tensors: how the
CPU tests check them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# what a program of the SiLU kernel takes of a row's columns
SILU_BLOCK = 1024
# every launch: no multiply and add contracted into one fused multiply-add, which rounds once where
# PyTorch's two operators round twice (the rotation's x * cos + swapped * sin in float32)
EXACT = {"enable_fp_fusion": False}


@triton.jit
def _add_rms_norm_kernel(
    h_ptr,
    delta_ptr,
    w_ptr,
    out_ptr,
    n,
    eps,
    HAS_DELTA: tl.constexpr,
    WEIGHT_IN_F32: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program a row: h += delta (stored, in h's dtype), then out = weight * norm(h)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    h = tl.load(h_ptr + row * n + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * n + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + d.to(tl.float32)).to(h.dtype)
        tl.store(h_ptr + row * n + cols, h, mask=mask)
    x = h.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if WEIGHT_IN_F32:  # float32: F.rms_norm with the weight
        y = x * inv * w
    else:  # normalized in float32, rounded, then scaled in the model's dtype (transformers)
        y = (x * inv).to(h.dtype).to(tl.float32) * w
    tl.store(out_ptr + row * n + cols, y.to(h.dtype), mask=mask)


@triton.jit
def _rotated(row, ds, c, s, mask, w_ptr, eps, D: tl.constexpr, NORM: tl.constexpr, WEIGHT_IN_F32: tl.constexpr):
    """The rotation of the heads at `row` (a [heads, 1] block of pointers): x * cos +
    swap_halves(x) * signed_sin, each product rounded to x's dtype, as PyTorch's four operators.
    With NORM, each head is first RMS-normed with the weight at `w_ptr` (a q/k norm), the swapped
    halves with the weight's swapped halves: the same values as norming first, then swapping."""
    x = tl.load(row + ds[None, :], mask=mask, other=0.0)
    half = (ds + D // 2) % D
    swapped = tl.load(row + half[None, :], mask=mask, other=0.0)
    dtype = x.dtype
    if NORM:  # as _add_rms_norm_kernel rounds it, the swapped halves by the same row's 1/rms
        xf, swapped_f = x.to(tl.float32), swapped.to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)[:, None]
        w = tl.load(w_ptr + ds, mask=ds < D, other=0.0).to(tl.float32)[None, :]
        w_swapped = tl.load(w_ptr + half, mask=ds < D, other=0.0).to(tl.float32)[None, :]
        if WEIGHT_IN_F32:
            x, swapped = (xf * inv * w).to(dtype), (swapped_f * inv * w_swapped).to(dtype)
        else:
            x = ((xf * inv).to(dtype).to(tl.float32) * w).to(dtype)
            swapped = ((swapped_f * inv).to(dtype).to(tl.float32) * w_swapped).to(dtype)
    a = (x.to(tl.float32) * c[None, :]).to(dtype)
    b = (swapped.to(tl.float32) * s[None, :]).to(dtype)
    return (a.to(tl.float32) + b.to(tl.float32)).to(dtype)


@triton.jit
def _rotary_write_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    kc_ptr,
    vc_ptr,
    qw_ptr,
    kw_ptr,
    stride_q,
    stride_k,
    stride_v,
    heads_q,
    heads_kv,
    num_slots,
    eps,
    D: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NORM: tl.constexpr,
    WEIGHT_IN_F32: tl.constexpr,
):
    """One program a token: its query and key heads (with NORM: RMS-normed by the weights at
    qw_ptr and kw_ptr first) rotated in place (as _rotary_kernel), then the rotated keys and the
    values copied to the token's slot of the caches [num_slots, heads_kv, D]. A slot out of range
    is not written (the engine never hands one out; index_copy_ would refuse it, a kernel must not
    write past the cache)."""
    t = tl.program_id(0).to(tl.int64)
    ds = tl.arange(0, BLOCK_D)
    c = tl.load(cos_ptr + t * D + ds, mask=ds < D, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * D + ds, mask=ds < D, other=0.0).to(tl.float32)
    hq = tl.arange(0, BLOCK_HQ)
    mask_q = (hq[:, None] < heads_q) & (ds[None, :] < D)
    row_q = q_ptr + t * stride_q + hq[:, None] * D
    q = _rotated(row_q, ds, c, s, mask_q, qw_ptr, eps, D, NORM, WEIGHT_IN_F32)
    tl.store(row_q + ds[None, :], q, mask=mask_q)
    hk = tl.arange(0, BLOCK_HKV)
    mask_k = (hk[:, None] < heads_kv) & (ds[None, :] < D)
    row_k = k_ptr + t * stride_k + hk[:, None] * D
    k = _rotated(row_k, ds, c, s, mask_k, kw_ptr, eps, D, NORM, WEIGHT_IN_F32)
    tl.store(row_k + ds[None, :], k, mask=mask_k)
    slot = tl.load(slot_ptr + t + hk * 0).to(tl.int64)[:, None]  # the slot in every head's row
    mask_slot = mask_k & (slot >= 0) & (slot < num_slots)
    cell = slot * heads_kv * D + hk[:, None] * D + ds[None, :]
    tl.store(kc_ptr + cell, k, mask=mask_slot)
    v = tl.load(v_ptr + t * stride_v + hk[:, None] * D + ds[None, :], mask=mask_slot, other=0.0)
    tl.store(vc_ptr + cell, v, mask=mask_slot)


@triton.jit
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    stride_t,
    heads,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program a row of x [T, H, D] (heads contiguous): x * cos + swap_halves(x) * signed_sin,
    each product rounded to x's dtype, in place."""
    t = tl.program_id(0).to(tl.int64)
    hs = tl.arange(0, BLOCK_H)
    ds = tl.arange(0, BLOCK_D)
    mask = (hs[:, None] < heads) & (ds[None, :] < D)
    row = x_ptr + t * stride_t + hs[:, None] * D
    c = tl.load(cos_ptr + t * D + ds, mask=ds < D, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * D + ds, mask=ds < D, other=0.0).to(tl.float32)
    tl.store(row + ds[None, :], _rotated(row, ds, c, s, mask, x_ptr, 0.0, D, False, False), mask=mask)


@triton.jit
def _silu_and_mul_kernel(gu_ptr, out_ptr, inner, BLOCK: tl.constexpr):
    """Program (row, column block): out = silu(gate) * up, SiLU's result rounded to the dtype
    before the product (F.silu(g) * u)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    g = tl.load(gu_ptr + row * 2 * inner + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * 2 * inner + inner + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out_ptr + row * inner + cols, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h += delta in place (in h's dtype) and returns weight * rms_norm(h), as ops.add_rms_norm;
    h, delta [..., n] contiguous, weight [n], one dtype (the caller checks)."""
    n = h.shape[-1]
    out = torch.empty_like(h)
    rows = h.numel() // n if n else 0
    if rows:
        _add_rms_norm_kernel[(rows,)](
            h,
            h if delta is None else delta,
            weight,
            out,
            n,
            float(eps),
            HAS_DELTA=delta is not None,
            WEIGHT_IN_F32=h.dtype == torch.float32,
            BLOCK=triton.next_power_of_2(n),
            **EXACT,
        )
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates x [T, H, D] in place by the [T, D] cos and signed-sine tables of
    layers.RotaryEmbedding (heads contiguous within a row, rows any distance apart; the caller
    checks)."""
    T, H, D = x.shape
    if T:
        _rotary_kernel[(T,)](
            x,
            cos,
            sin,
            x.stride(0),
            H,
            D=D,
            BLOCK_H=triton.next_power_of_2(H),
            BLOCK_D=triton.next_power_of_2(D),
            **EXACT,
        )


def rotary_write_kv_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> None:
    """Rotates q [T, Hq, D] and k [T, Hkv, D] in place by the [T, D] tables and writes k and v
    [T, Hkv, D] to rows `slots` [T] (int64) of the caches [num_slots, Hkv, D]: rotary_ on both,
    then index_copy_ of each, in one launch. `norms` (q's weight, k's weight, eps): each head
    RMS-normed first, as add_rms_norm norms it (a q/k norm). Heads contiguous within a row, rows any
    distance apart, the caches and weights contiguous; the caller checks."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    q_weight, k_weight, eps = norms if norms is not None else (q, k, 0.0)
    if T:
        _rotary_write_kv_kernel[(T,)](
            q,
            k,
            v,
            cos,
            sin,
            slots,
            k_cache,
            v_cache,
            q_weight,
            k_weight,
            q.stride(0),
            k.stride(0),
            v.stride(0),
            Hq,
            Hkv,
            k_cache.shape[0],
            float(eps),
            D=D,
            BLOCK_HQ=triton.next_power_of_2(Hq),
            BLOCK_HKV=triton.next_power_of_2(Hkv),
            BLOCK_D=triton.next_power_of_2(D),
            NORM=norms is not None,
            WEIGHT_IN_F32=q.dtype == torch.float32,
            **EXACT,
        )


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a contiguous [..., 2 * I] (gate first), as ops.silu_and_mul."""
    inner = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], inner, dtype=gate_up.dtype, device=gate_up.device)
    rows = out.numel() // inner if inner else 0
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(inner, SILU_BLOCK))](gate_up, out, inner, BLOCK=SILU_BLOCK, **EXACT)
    return out
