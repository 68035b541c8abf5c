"""A GPU's row-wise steps fused into one Triton kernel each: the residual add with the RMSNorm after
it, the rotary embedding of a layer's queries and keys, and SiLU-and-multiply. The same three steps
as the CPU's native kernels (`ops.add_rms_norm`, `ops.rotary_`, `ops.silu_and_mul`), with their
semantics: PyTorch's formulation (kernels/reference.py) runs each as several kernels (a norm: a
float32 copy, the norm, a copy back, the weight's product, the residual add; the rotation four;
SiLU-and-multiply two).

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
    x = tl.load(row + ds[None, :], mask=mask, other=0.0)
    swapped = tl.load(row + ((ds + D // 2) % D)[None, :], mask=mask, other=0.0)
    c = tl.load(cos_ptr + t * D + ds, mask=ds < D, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * D + ds, mask=ds < D, other=0.0).to(tl.float32)
    a = (x.to(tl.float32) * c[None, :]).to(x.dtype)
    b = (swapped.to(tl.float32) * s[None, :]).to(x.dtype)
    tl.store(row + ds[None, :], (a.to(tl.float32) + b.to(tl.float32)).to(x.dtype), mask=mask)


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


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a contiguous [..., 2 * I] (gate first), as ops.silu_and_mul."""
    inner = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], inner, dtype=gate_up.dtype, device=gate_up.device)
    rows = out.numel() // inner if inner else 0
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(inner, SILU_BLOCK))](gate_up, out, inner, BLOCK=SILU_BLOCK, **EXACT)
    return out
