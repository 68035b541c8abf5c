"""The chains of a recurrent mixed step over fixed buffers (model/kernels/triton_scan.py) against
the eager rounds' operations, on a GPU compiled and on a CPU under Triton's interpreter: each
request's chain from its initial state, chains sharing their first segments (a request continuing
from a block another writes in the same step), padding requests of no segment. Their compile for an
H100 is in test_triton_attention.py (triton_compile.py)."""

from __future__ import annotations

import pytest
import torch

from .triton_interpreter import device, kernels_module

# request 0: segments 0, 1, 2; request 1 continues from segment 1 (0, 1, then its own 3, from request
# 0's initial state: both write segments 0 and 1, the same values); request 2: segment 4 alone;
# request 3: padding (no segment); segment 5 is no one's (a padding segment)
CHAINS = [[0, 1, 2], [0, 1, 3], [4], []]


@pytest.fixture(scope="module")
def ts():
    kernels_module()
    from prefixkv.model.kernels import triton_scan

    return triton_scan


def _chains() -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(c) for c in CHAINS)
    chains = torch.tensor([c + [0] * (width - len(c)) for c in CHAINS], dtype=torch.int32, device=device())
    return chains, torch.tensor([len(c) for c in CHAINS], dtype=torch.int32, device=device())


def _walk(initial, step, segments: int, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager order: each chain from its request's initial state, one segment after another."""
    before = torch.zeros(segments, *shape, device=device())
    after = torch.zeros(segments, *shape, device=device())
    for r, chain in enumerate(CHAINS):
        state = initial[r]
        for s in chain:
            before[s] = state
            state = step(s, state)
            after[s] = state
    return before, after


def test_scalar_decay_chains_equal_the_eager_operations_bit_for_bit(ts):
    gen = torch.Generator().manual_seed(0)
    H, P, N, S = 3, 4, 300, 6  # 1,200 elements a head: a whole block of 1,024 and a part of one
    initial = torch.randn(len(CHAINS), H, P, N, generator=gen)
    initial[1] = initial[0]  # a continuing request starts where its writer does (scan_host_inputs)
    initial = initial.to(device())
    decay = torch.rand(S, H, generator=gen).to(device())
    chunk = torch.randn(S, H, P, N, generator=gen).to(device())
    chains, lens = _chains()
    before, after = torch.zeros_like(chunk), torch.zeros_like(chunk)
    ts.chain_states(initial, decay, chunk, chains, lens, before, after)
    want_before, want_after = _walk(initial, lambda s, st: st * decay[s][:, None, None] + chunk[s], S, (H, P, N))
    assert torch.equal(before, want_before) and torch.equal(after, want_after)
    assert not after[5].any()  # a segment no chain names is left as it was


def test_matrix_chains_equal_the_eager_products(ts):
    gen = torch.Generator().manual_seed(1)
    H, DK, DV, S = 2, 24, 40, 6  # both padded inside the kernel (to 32, and 16-wide value blocks)
    initial = torch.randn(len(CHAINS), H, DK, DV, generator=gen)
    initial[1] = initial[0]
    initial = initial.to(device())
    a = (0.2 * torch.randn(S, H, DK, DK, generator=gen)).to(device())
    b = torch.randn(S, H, DK, DV, generator=gen).to(device())
    chains, lens = _chains()
    before, after = torch.zeros_like(b), torch.zeros_like(b)
    ts.matrix_chain_states(initial, a, b, chains, lens, before, after)
    want_before, want_after = _walk(initial, lambda s, st: torch.baddbmm(b[s], a[s], st), S, (H, DK, DV))
    torch.testing.assert_close(before, want_before, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after, want_after, rtol=1e-5, atol=1e-5)
    assert not after[5].any()
