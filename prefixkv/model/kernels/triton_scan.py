"""The recurrence across a mixed step's segments of a recurrent layer's chunked scan, as one Triton
kernel over a fixed grid: what a CUDA graph of a recurrent model's mixed step captures - a Mamba2
mixer's (model/mamba2.py: a scalar decay a head) and a gated delta net's (model/gated_delta.py: a
matrix a head, state = A @ state + B).

Each request's new tokens are cut into block-aligned segments; within a segment the scan's
quadratic form runs batched over every segment at once, and across a request's segments the state
follows state = state * decay + chunk_state, in order. The eager step runs that recurrence round
by round from a plan the host makes per step, whose shape follows the blocks the prompts cross.
Here each program takes one request's chain of segments (its segment ids in order, a count that
may be 0), one head and a block of the state's elements, and walks the chain: the launch's shape
depends on the buffers alone. A multiply and an add are not fused into one (EXACT), as PyTorch's two
operators round twice; the delta net's product is taken in full float32 (no TF32), its sum in the
kernel's order rather than PyTorch's: equal to the eager rounds to rounding, not bit for bit.

Under ``TRITON_INTERPRET=1`` it runs on CPU tensors: how the CPU tests check it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_fused import EXACT

BLOCK = 1024


@triton.jit
def _chain_states_kernel(
    initial_ptr,  # [R, H, E] float32: each request's state before its first segment
    decay_ptr,  # [S, H] float32
    chunk_ptr,  # [S, H, E] float32: what each segment adds
    chains_ptr,  # [R, width] int32: each request's segments in order
    chain_len_ptr,  # [R] int32
    before_ptr,  # [S, H, E] float32 out: the state each segment starts from
    after_ptr,  # [S, H, E] float32 out: the state after it
    H,
    E,
    width,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < E
    n = tl.load(chain_len_ptr + r)
    state = tl.load(initial_ptr + (r * H + h) * E + cols, mask=mask, other=0.0)
    for k in range(0, n):
        seg = tl.load(chains_ptr + r * width + k).to(tl.int64)
        at = (seg * H + h) * E + cols
        tl.store(before_ptr + at, state, mask=mask)
        d = tl.load(decay_ptr + seg * H + h)
        state = state * d + tl.load(chunk_ptr + at, mask=mask, other=0.0)
        tl.store(after_ptr + at, state, mask=mask)


def chain_states(
    initial: torch.Tensor,
    decay: torch.Tensor,
    chunk_state: torch.Tensor,
    chains: torch.Tensor,
    chain_len: torch.Tensor,
    before: torch.Tensor,
    after: torch.Tensor,
) -> None:
    """Fills `before` and `after` [S, H, ...] (float32) for every segment a chain names: request r's
    k-th segment chains[r, k] (k < chain_len[r]) starts from the state its (k-1)-th ended in, the
    first from initial[r] [R, H, ...]. Segments no chain names are left as they were."""
    R, H = initial.shape[:2]
    E = initial[0, 0].numel()
    grid = (R, H, triton.cdiv(E, BLOCK))
    _chain_states_kernel[grid](
        initial.contiguous(), decay.contiguous(), chunk_state.contiguous(), chains, chain_len, before, after,
        H, E, chains.shape[1], BLOCK=BLOCK, **EXACT,
    )  # fmt: skip


@triton.jit
def _matrix_chain_kernel(
    initial_ptr,  # [R, H, DK, DV] float32
    a_ptr,  # [S, H, DK, DK] float32
    b_ptr,  # [S, H, DK, DV] float32
    chains_ptr,
    chain_len_ptr,
    before_ptr,  # [S, H, DK, DV] float32 out
    after_ptr,  # [S, H, DK, DV] float32 out
    H,
    width,
    DK: tl.constexpr,
    DV: tl.constexpr,
    DKP: tl.constexpr,  # DK padded to a power of two of at least 16 (what tl.dot takes)
    BV: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    ks = tl.arange(0, DKP)
    vs = tl.program_id(2) * BV + tl.arange(0, BV)
    kmask = ks < DK
    state_mask = kmask[:, None] & (vs < DV)[None, :]
    square_mask = kmask[:, None] & kmask[None, :]
    n = tl.load(chain_len_ptr + r)
    state = tl.load(initial_ptr + ((r * H + h) * DK + ks[:, None]) * DV + vs[None, :], mask=state_mask, other=0.0)
    for k in range(0, n):
        base = tl.load(chains_ptr + r * width + k).to(tl.int64) * H + h
        at = (base * DK + ks[:, None]) * DV + vs[None, :]
        tl.store(before_ptr + at, state, mask=state_mask)
        a = tl.load(a_ptr + (base * DK + ks[:, None]) * DK + ks[None, :], mask=square_mask, other=0.0)
        state = tl.dot(a, state, input_precision="ieee") + tl.load(b_ptr + at, mask=state_mask, other=0.0)
        tl.store(after_ptr + at, state, mask=state_mask)


def matrix_chain_states(
    initial: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    chains: torch.Tensor,
    chain_len: torch.Tensor,
    before: torch.Tensor,
    after: torch.Tensor,
) -> None:
    """As `chain_states` with state = a[s] @ state + b[s]: `initial` [R, H, dk, dv], `a` [S, H, dk,
    dk], `b`, `before`, `after` [S, H, dk, dv], all float32."""
    R, H, dk, dv = initial.shape
    dkp = max(16, triton.next_power_of_2(dk))
    bv = max(16, min(64, triton.next_power_of_2(dv)))
    grid = (R, H, triton.cdiv(dv, bv))
    _matrix_chain_kernel[grid](
        initial.contiguous(), a.contiguous(), b.contiguous(), chains, chain_len, before, after,
        H, chains.shape[1], DK=dk, DV=dv, DKP=dkp, BV=bv, **EXACT,
    )  # fmt: skip
