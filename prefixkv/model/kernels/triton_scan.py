"""The recurrence across a mixed step's segments of a Mamba2 scan, as one Triton kernel over a
fixed grid: what a CUDA graph of a recurrent model's mixed step captures (model/mamba2.py).

Each request's new tokens are cut into block-aligned segments; within a segment the scan's
quadratic form runs batched over every segment at once, and across a request's segments the state
follows state = state * decay + chunk_state, in order. The eager step runs that recurrence round
by round from a plan the host makes per step, whose shape follows the blocks the prompts cross.
Here each program takes one request's chain of segments (its segment ids in order, a count that
may be 0), one head and a block of the state's elements, and walks the chain: the launch's shape
depends on the buffers alone. A multiply and an add are not fused into one (EXACT), as PyTorch's two
operators round twice.

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
