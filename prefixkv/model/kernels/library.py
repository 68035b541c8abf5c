"""The compiled kernel library loaded through ctypes: each entry point's C signature and one
`CpuKernels` object holding the functions that passed their start-up check."""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass
from typing import Any

import torch

from .build import ARCH_ENV, arch, arch_runs_here, build, compiler, flags_for

# Each entry point's arguments, as its C declaration spells them (int64_t sizes, float scales, the
# dtype as a code first, the thread count last).
_I, _I64, _P, _F = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_SIGNATURES: dict[str, list[Any]] = {
    # (dtype, D, q, k, v, slots, lens, out, lse, B, L, Hkv, G, scale, threads)
    "prefixkv_decode_attention": [_I, _I64, *[_P] * 7, *[_I64] * 4, _F, _I],
    # (dtype, D, q, q_stride, k, v, seqs, slots, out, lse, S, Hkv, G, scale, threads)
    "prefixkv_prefill_attention": [_I, _I64, _P, _I64, *[_P] * 6, *[_I64] * 3, _F, _I],
    "prefixkv_prefill_attention_unit": [],
    # (dtype, gu, out, rows, I, threads)
    "prefixkv_silu_and_mul": [_I, _P, _P, _I64, _I64, _I],
    # (dtype, x, row_stride, T, H, D, cos, sin, threads)
    "prefixkv_rotary": [_I, _P, *[_I64] * 4, _P, _P, _I],
    # (dtype, h, delta, weight, out, rows, dim, eps, threads)
    "prefixkv_add_rms_norm": [_I, *[_P] * 4, _I64, _I64, _F, _I],
    "prefixkv_small_linear_available": [],
    # (dtype, x, x_row_stride, packed weight, bias, y, M, K, N, threads)
    "prefixkv_small_linear": [_I, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _I],
    "prefixkv_blocked_linear_available": [],
    # (dtype, x, x_row_stride, packed weight, bias, y, M, K, N, threads): small_linear's arguments
    "prefixkv_blocked_linear": [_I, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _I],
    # (dtype, dims, weights, caches, h, x, cos, sin, slot_mapping, slots, lens, eps, scale, threads)
    "prefixkv_decode_layers": [_I, *[_P] * 10, _F, _F, _I],
    # (element size, k, k_row_stride, v, v_row_stride, slots, T, row, k_cache, v_cache, num_slots, threads)
    "prefixkv_write_kv": [_I64, _P, _I64, _P, _I64, _P, _I64, _I64, _P, _P, _I64, _I],
}


def load() -> tuple[ctypes.CDLL, str]:
    """Build (or find in the build cache) the library for this CPU's arch level and load it with
    every entry point's signature set; returns it and its file name."""
    if not sys.platform.startswith("linux"):
        raise RuntimeError("only built on Linux")
    if not torch.backends.openmp.is_available():  # type: ignore[no-untyped-call]
        raise RuntimeError("this torch has no OpenMP runtime to share")
    target = arch()
    if not arch_runs_here(target):
        raise RuntimeError(f"{ARCH_ENV}={target}: this CPU lacks its instructions")
    path = build(compiler(), flags=flags_for(target))
    lib = ctypes.CDLL(str(path))
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int  # 0, or non-zero for what the kernel does not take
        fn.argtypes = argtypes
    return lib, path.name


@dataclass(frozen=True)
class CpuKernels:
    """The loaded library's functions that agreed with the PyTorch path at start-up."""

    decode_attention: Any
    add_rms_norm: Any
    prefill_attention: Any
    # what bfloat16 prefill attention multiplies on: 1 the tile unit (AMX), 2 vector dot products
    # (AVX512-BF16), 0 float32 vectors
    prefill_unit: int
    silu_and_mul: Any
    rotary: Any
    write_kv: Any
    small_linear: Any | None = None  # None where it disagreed with F.linear
    small_linear_dtypes: frozenset[torch.dtype] = frozenset()  # those it has passed its check for
    decode_layers: Any | None = None  # built of the checked kernels' own pieces (csrc/kernels.h)
    blocked_linear: Any | None = None  # None where it disagreed with the small-batch linear
    blocked_linear_dtypes: frozenset[torch.dtype] = frozenset()
