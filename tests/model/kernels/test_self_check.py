"""Every kernel this CPU's build has passes its own check against the PyTorch path
(prefixkv/model/kernels/self_check.py). The engine sets a kernel that fails it aside and runs the
PyTorch path instead - right outputs, slower - and the kernel tests then skip as on a CPU without
the instructions; here a wrong kernel fails instead of going unseen."""

from __future__ import annotations

import shutil

import pytest

from prefixkv.model.kernels import library, ops, self_check

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no compiler")


def built_library():
    try:
        lib, _name = library.load()
    except RuntimeError as e:  # not Linux, no OpenMP in this torch, an arch level the CPU lacks
        pytest.skip(str(e))
    return lib


def test_the_attention_norm_silu_and_rotary_kernels_agree():
    lib = built_library()
    assert self_check.kernels_agree(
        lib.prefixkv_decode_attention,
        lib.prefixkv_add_rms_norm,
        lib.prefixkv_prefill_attention,
        lib.prefixkv_silu_and_mul,
        lib.prefixkv_rotary,
    )


@pytest.mark.parametrize("dtype", sorted(ops.DTYPE_BITS, key=str), ids=str)
def test_every_linear_kernel_built_for_this_cpu_agrees(dtype):
    lib = built_library()
    if not lib.prefixkv_small_linear_available() & ops.DTYPE_BITS[dtype]:
        pytest.skip(f"no native linear for {dtype} in this CPU's build")
    assert self_check.small_linear_agrees(lib.prefixkv_small_linear, dtype)
    if lib.prefixkv_blocked_linear_available() & ops.DTYPE_BITS[dtype]:
        assert self_check.blocked_linear_agrees(lib.prefixkv_blocked_linear, lib.prefixkv_small_linear, dtype)
