"""A one-row decode step's products with the row-wise step before each folded in: the residual add
and RMSNorm before q/k/v and before gate/up, SiLU-and-multiply before down, each in the product's
own Triton kernel (triton_fused.py runs them as kernels of their own).

Why: at batch 1 a step is a few dozen small kernels between its products, each a few microseconds
on a GPU whatever its size, inside a CUDA graph too (an H200 ran the Llama-3.2-1B shape's step in
0.90 ms of device time for 0.49 ms of weights to read, docs/benchmarks.md). Whether this kernel's
product beats cuBLAS's on a card is measured there, not assumed: the engine captures the batch-1
decode graph both ways and keeps the faster (engine/cuda_graphs.StepGraphs._choose_one_row).

Rounding: the folded step's values are the separate kernel's bit for bit where the row's sum of
squares is (every element rounded where `_add_rms_norm_kernel` and `_silu_and_mul_kernel` round
it; the row's squares summed in one reduction of the same width, as there); the product adds in
its own order, so it matches cuBLAS's to rounding. EXACT: no fused multiply-add.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from .triton_fused import EXACT

# output rows a program computes, and the columns of each step of its loop over the row
BLOCK_N = 8
BLOCK_K = 512


@triton.jit
def _prologue_gemv_kernel(
    x_ptr,
    delta_ptr,
    nw_ptr,
    w_ptr,
    out_ptr,
    h_out_ptr,
    N,
    K,
    eps,
    PROLOGUE: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    WEIGHT_IN_F32: tl.constexpr,
    K_POW2: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[n] = sum_k W[n, k] * a[k] for BLOCK_N rows n of W [N, K]. PROLOGUE 1: h = x (+ delta,
    rounded to x's dtype; program 0 stores it in h_out) and a = RMSNorm(h) by nw; PROLOGUE 2: a =
    silu(x[:K]) * x[K:]."""
    pid = tl.program_id(0)
    ns = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    inv = 1.0
    if PROLOGUE == 1:  # the row's 1/rms, as _add_rms_norm_kernel takes it: one sum over the whole row
        cols = tl.arange(0, K_POW2)
        row_ok = cols < K
        h = tl.load(x_ptr + cols, mask=row_ok, other=0.0)
        if HAS_DELTA:
            h = (h.to(tl.float32) + tl.load(delta_ptr + cols, mask=row_ok, other=0.0).to(tl.float32)).to(h.dtype)
            if pid == 0:
                tl.store(h_out_ptr + cols, h, mask=row_ok)
        hf = h.to(tl.float32)
        inv = tl.rsqrt(tl.sum(hf * hf, axis=0) / K + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_ptr + ks, mask=k_ok, other=0.0)
        if PROLOGUE == 1:
            if HAS_DELTA:
                a = (a.to(tl.float32) + tl.load(delta_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)).to(a.dtype)
            nw = tl.load(nw_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            if WEIGHT_IN_F32:  # float32: F.rms_norm with the weight
                a = (a.to(tl.float32) * inv * nw).to(a.dtype)
            else:  # normalized in float32, rounded, then scaled in the model's dtype (transformers)
                a = ((a.to(tl.float32) * inv).to(a.dtype).to(tl.float32) * nw).to(a.dtype)
        if PROLOGUE == 2:
            g = a.to(tl.float32)
            up = tl.load(x_ptr + K + ks, mask=k_ok, other=0.0).to(tl.float32)
            a = ((g / (1.0 + tl.exp(-g))).to(a.dtype).to(tl.float32) * up).to(a.dtype)
        w = tl.load(w_ptr + ns[:, None] * K + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
    tl.store(out_ptr + ns, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=n_ok)


def launch(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    prologue: int,
    kernel: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the new residual, or x itself without `delta`; the product [1, N]) by `kernel`: the
    engine's `_prologue_gemv_kernel` at BLOCK_N x BLOCK_K, or another build of it that picks its
    own blocks (bench/fused_gemv.py's autotuned one)."""
    N, K = weight.shape
    out = torch.empty(1, N, dtype=x.dtype, device=x.device)
    h_out = torch.empty_like(x) if delta is not None else x
    blocks: dict[str, int] = {}
    if kernel is None:
        kernel, blocks = _prologue_gemv_kernel, {"BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K}
    kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)](
        x,
        x if delta is None else delta,
        x if norm_weight is None else norm_weight,
        weight,
        out,
        h_out,
        N,
        K,
        float(eps),
        PROLOGUE=prologue,
        HAS_DELTA=delta is not None,
        WEIGHT_IN_F32=x.dtype == torch.float32,
        K_POW2=triton.next_power_of_2(K) if prologue == 1 else 1,  # (read by the norm alone)
        **blocks,
        **EXACT,
    )
    return h_out, out


def norm_linear(
    h: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, RMSNorm(h + delta) @ weight.T) for one row h [1, K] (delta None: h itself),
    the new residual in a tensor of its own; contiguous, one dtype (the caller checks)."""
    return launch(h, delta, norm_weight, weight, eps, 1)


def silu_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(silu(gate) * up) @ weight.T for one row gate_up [1, 2K] (gate first)."""
    return launch(gate_up, None, None, weight, 0.0, 2)[1]
