"""The freshly loaded kernels against the PyTorch path (reference.py) on small cases, both
dtypes, before any of them runs: a kernel that disagrees is not used."""

from __future__ import annotations

import ctypes

import torch

from . import calls
from .calls import DTYPE_CODES, HEAD_DIMS
from .reference import (
    reference_add_rms_norm,
    reference_decode_attention_lse,
    reference_prefill_attention,
    reference_rotary,
    reference_silu_and_mul,
)


def kernels_agree(
    attention: ctypes._CFuncPtr,  # type: ignore[name-defined]
    norm: ctypes._CFuncPtr,  # type: ignore[name-defined]
    prefill: ctypes._CFuncPtr,  # type: ignore[name-defined]
    silu: ctypes._CFuncPtr,  # type: ignore[name-defined]
    rotary: ctypes._CFuncPtr,  # type: ignore[name-defined]
) -> bool:
    """The freshly loaded kernels against the PyTorch path on small cases, both dtypes."""
    g = torch.Generator().manual_seed(0)
    slots = torch.randperm(64, generator=g)[: 3 * 20].view(3, 20)
    lens = torch.tensor([20, 7, 1])
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for D in HEAD_DIMS:
            q = torch.randn(3, 6, D, generator=g).to(dtype)
            k = torch.randn(64, 2, D, generator=g).to(dtype)
            v = torch.randn(64, 2, D, generator=g).to(dtype)
            lse = torch.empty(3, 6)
            got = calls.decode_attention_call(attention, DTYPE_CODES[dtype], q, k, v, slots, lens, D**-0.5, lse)
            want, want_lse = reference_decode_attention_lse(q, k, v, slots, lens, D**-0.5)
            if got is None or not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol):
                return False
            if not torch.allclose(lse, want_lse, rtol=1e-5, atol=1e-5):
                return False
            # two sequences: a whole 70-token prompt, and 5 new tokens after 40 cached ones
            q = torch.randn(75, 6, D, generator=g).to(dtype)
            seqs = torch.tensor([[0, 70, 70, 0], [70, 5, 45, 70]])
            runs = torch.cat([torch.randperm(64, generator=g) for _ in range(2)])[:115]
            got_out, want_out = torch.zeros_like(q), torch.zeros_like(q)
            got_lse, want_lse = torch.zeros(75, 6), torch.zeros(75, 6)
            code = DTYPE_CODES[dtype]
            if not calls.prefill_attention_call(prefill, code, q, k, v, seqs, runs, D**-0.5, got_out, got_lse):
                return False
            reference_prefill_attention(q, k, v, seqs, runs, D**-0.5, want_out, want_lse)
            if not torch.allclose(got_out.float(), want_out.float(), rtol=tol, atol=tol):
                return False
            if not torch.allclose(got_lse, want_lse, rtol=1e-5, atol=1e-5):
                return False
        gate_up = (torch.randn(7, 2 * 83, generator=g) * 4).to(dtype)  # 83: a vector tail too
        got = calls.silu_and_mul_call(silu, DTYPE_CODES[dtype], gate_up)
        if got is None or not torch.allclose(got.float(), reference_silu_and_mul(gate_up).float(), rtol=tol, atol=tol):
            return False
        for D in (64, 40):  # 40: a half that is not a multiple of 16
            x = torch.randn(6, 5, D, generator=g).to(dtype)[:, :3]  # rows 5 * D apart
            angles = torch.rand(6, D // 2, generator=g) * 6
            cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
            sin = torch.cat((-angles.sin(), angles.sin()), -1).to(dtype)
            want_rot = reference_rotary(x, cos, sin)
            if not calls.rotary_call(rotary, DTYPE_CODES[dtype], x, cos, sin) or not torch.equal(x, want_rot):
                return False
        h = torch.randn(5, 96, generator=g).to(dtype)
        delta = torch.randn(5, 96, generator=g).to(dtype)
        weight = (torch.rand(96, generator=g) + 0.5).to(dtype)
        want_h, want = reference_add_rms_norm(h, delta, weight, 1e-5)
        got = calls.add_rms_norm_call(norm, DTYPE_CODES[dtype], h, delta, weight, 1e-5)
        if (
            got is None
            or not torch.equal(h, want_h)
            or not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)
        ):
            return False
    return True


def small_linear_agrees(fn: ctypes._CFuncPtr, dtype: torch.dtype) -> bool:  # type: ignore[name-defined]
    """The freshly loaded small-batch linear against F.linear: 1, 5 and 11 rows (two passes of 8),
    37 outputs (a padded last block), with and without bias."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(37, 64, generator=g).to(dtype)
    bias = torch.randn(37, generator=g)
    packed = calls.small_linear_layout(weight)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for rows in (1, 5, 11):
        x = torch.randn(rows, 64, generator=g).to(dtype)
        for b in (None, bias):
            got = calls.small_linear_call(fn, x, packed, 37, b)
            want = torch.nn.functional.linear(x.float(), weight.float(), b)
            if got is None or not torch.allclose(got.float(), want, rtol=tol, atol=tol):
                return False
    return True


def blocked_linear_agrees(
    blocked: ctypes._CFuncPtr,  # type: ignore[name-defined]
    small: ctypes._CFuncPtr,  # type: ignore[name-defined]
    dtype: torch.dtype,
) -> bool:
    """The freshly loaded many-row linear against the small-batch one it must equal bit for bit (and
    so F.linear up to rounding, small_linear_agrees): 1, 13 and 250 rows (a partial tile, two chunks),
    37 outputs, 64 inputs, with and without bias, the rows 3 values longer than K."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(37, 64, generator=g).to(dtype)
    bias = torch.randn(37, generator=g)
    packed = calls.small_linear_layout(weight)
    for rows in (1, 13, 250):
        x = torch.randn(rows, 67, generator=g).to(dtype)[:, :64]
        for b in (None, bias):
            got = calls.small_linear_call(blocked, x, packed, 37, b)
            want = calls.small_linear_call(small, x, packed, 37, b)
            if (
                got is None
                or want is None
                or not torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))
            ):
                return False
    return True
