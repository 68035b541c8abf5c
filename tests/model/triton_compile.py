"""Compiles the Triton kernels (attention; the fused norm, rotary (with the K/V write) and SiLU; a one-row step's
products with the step before folded in; the recurrent scans' chains) for a GPU without one:
Triton's own compiler down to the GPU's machine code (ptxas, shipped in Triton's wheel), with the
compile-time arguments the kernels' entry points give their launches. Run as a script, in a process
that has not imported Triton under its interpreter:

    python -m tests.model.triton_compile [capability ...]   (default 90: H100, H200)

Prints one line a variant and exits non-zero at the first that does not compile."""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from prefixkv.model.kernels import triton_attention as ta
from prefixkv.model.kernels import triton_fused as tf
from prefixkv.model.kernels import triton_gemv as tg
from prefixkv.model.kernels import triton_scan as ts

POINTERS = {"bt_ptr": "*i32", "seq_lens_ptr": "*i32", "q_start_ptr": "*i32", "q_len_ptr": "*i32"}
TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}
# pointers to the model's dtype (the rest point to float32 partial results)
DATA_POINTERS = {"q_ptr", "k_ptr", "v_ptr", "o_ptr", "h_ptr", "delta_ptr", "w_ptr", "out_ptr", "x_ptr", "cos_ptr"}
DATA_POINTERS |= {"sin_ptr", "gu_ptr", "kc_ptr", "vc_ptr", "qw_ptr", "kw_ptr", "nw_ptr", "h_out_ptr"}
POINTERS["slot_ptr"] = "*i64"
POINTERS["tile_map_ptr"] = "*i32"
POINTERS |= {"chains_ptr": "*i32", "chain_len_ptr": "*i32"}


def _signature(fn: Any, dtype: torch.dtype, constants: dict[str, Any]) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in constants:
            sig[name] = "constexpr"
        elif name in POINTERS:
            sig[name] = POINTERS[name]
        elif name in DATA_POINTERS:
            sig[name] = TYPES[dtype]
        elif name.endswith("_ptr"):
            sig[name] = "*fp32"  # log-sum-exps, partial results
        else:
            sig[name] = "fp32" if name in ("scale", "eps", "softcap") else "i32"
    return sig


def variants() -> list[tuple[Any, torch.dtype, dict[str, Any]]]:
    """(kernel, dtype, constants): the default model's shapes (9 query heads on 3 KV heads of 64)
    and an 8B Llama's (32 on 8 of 128), each kernel's options."""
    out: list[tuple[Any, torch.dtype, dict[str, Any]]] = []
    for dtype, group, dim in ((torch.bfloat16, 3, 64), (torch.bfloat16, 4, 128), (torch.float16, 3, 64)):
        out.append((ta._decode_kernel, dtype, ta.decode_constants(dtype, True, group, dim, 16, 4, False, True)))
        out.append((ta._prefill_kernel, dtype, ta.prefill_constants(dtype, True, group, dim, 16, 512, True, True)))
    out.append((ta._decode_kernel, torch.float32, ta.decode_constants(torch.float32, True, 3, 64, 16, 1, True, False)))
    out.append(
        (ta._prefill_kernel, torch.float32, ta.prefill_constants(torch.float32, True, 3, 64, 16, 9, False, False))
    )
    # over a tile map (a captured mixed step): the default model's shapes and an 8B's, bfloat16
    for group, dim in ((3, 64), (4, 128)):
        tiled = ta.prefill_constants(torch.bfloat16, True, group, dim, 16, 1 << 30, False, False)
        out.append((ta._prefill_kernel, torch.bfloat16, {**tiled, "TILE_MAP": True}))
    # soft-capped scores (Gemma 2 2B's heads: 8 on 4 KV heads of 256), decode and a tile map
    capped = ta.decode_constants(torch.bfloat16, True, 2, 256, 16, 4, True, True, True)
    out.append((ta._decode_kernel, torch.bfloat16, capped))
    capped = ta.prefill_constants(torch.bfloat16, True, 2, 256, 16, 1 << 30, True, False, True)
    out.append((ta._prefill_kernel, torch.bfloat16, {**capped, "TILE_MAP": True}))
    reduce = dict(NUM_SPLITS=4, D=64, BLOCK_S=4, BLOCK_D=64, HAS_LSE=True)
    out.append((ta._reduce_kernel, torch.bfloat16, reduce))
    # the fused steps: the default model's widths in bfloat16, an 8B Llama's in float32
    norm = tf._add_rms_norm_kernel
    out.append((norm, torch.bfloat16, dict(HAS_DELTA=True, WEIGHT_IN_F32=False, BLOCK=1024, **tf.EXACT)))
    out.append((norm, torch.float32, dict(HAS_DELTA=False, WEIGHT_IN_F32=True, BLOCK=4096, **tf.EXACT)))
    out.append((tf._rotary_kernel, torch.bfloat16, dict(D=64, BLOCK_H=16, BLOCK_D=64, **tf.EXACT)))
    out.append((tf._rotary_kernel, torch.float32, dict(D=128, BLOCK_H=64, BLOCK_D=128, **tf.EXACT)))
    rotate_write = tf._rotary_write_kv_kernel
    for dtype, heads, kv_heads, dim, norm in ((torch.bfloat16, 16, 4, 64, False), (torch.bfloat16, 32, 8, 128, True)):
        blocks = dict(D=dim, BLOCK_HQ=heads, BLOCK_HKV=kv_heads, BLOCK_D=dim)
        out.append((rotate_write, dtype, dict(**blocks, NORM=norm, WEIGHT_IN_F32=False, **tf.EXACT)))
    blocks = dict(D=64, BLOCK_HQ=16, BLOCK_HKV=4, BLOCK_D=64)
    out.append((rotate_write, torch.float32, dict(**blocks, NORM=True, WEIGHT_IN_F32=True, **tf.EXACT)))
    out.append((tf._silu_and_mul_kernel, torch.bfloat16, dict(BLOCK=tf.SILU_BLOCK, **tf.EXACT)))
    out.append((tf._silu_and_mul_kernel, torch.float32, dict(BLOCK=tf.SILU_BLOCK, **tf.EXACT)))
    # a one-row step's products with the step before folded in: the 1B's widths in bfloat16, the
    # default model's in float32
    gemv = dict(BLOCK_N=tg.BLOCK_N, BLOCK_K=tg.BLOCK_K, **tf.EXACT)
    for dtype, width in ((torch.bfloat16, 2048), (torch.float32, 576)):
        f32 = dtype == torch.float32
        for delta in (False, True):
            norm = dict(PROLOGUE=1, HAS_DELTA=delta, WEIGHT_IN_F32=f32, K_POW2=triton.next_power_of_2(width))
            out.append((tg._prologue_gemv_kernel, dtype, {**norm, **gemv}))
        silu = dict(PROLOGUE=2, HAS_DELTA=False, WEIGHT_IN_F32=f32, K_POW2=1)
        out.append((tg._prologue_gemv_kernel, dtype, {**silu, **gemv}))
    # a recurrent mixed step's chains: a Mamba2 mixer's (float32 states), Qwen3-Next's delta nets (128 x 128 heads)
    out.append((ts._chain_states_kernel, torch.float32, dict(BLOCK=ts.BLOCK, **tf.EXACT)))
    matrix = dict(DK=128, DV=128, DKP=128, BV=64, **tf.EXACT)
    out.append((ts._matrix_chain_kernel, torch.float32, matrix))
    return out


def main(capabilities: list[int]) -> None:
    for cap in capabilities:
        for fn, dtype, constants in variants():
            start = time.perf_counter()
            options = {k: constants.pop(k) for k in ("num_warps", "num_stages", "enable_fp_fusion") if k in constants}
            src = ASTSource(fn=fn, signature=_signature(fn, dtype, constants), constexprs=constants)
            kernel = triton.compile(src, target=GPUTarget("cuda", cap, 32), options=options)
            took = time.perf_counter() - start
            print(f"sm_{cap} {fn.__name__} {dtype}: {len(kernel.asm['cubin'])} bytes in {took:.1f} s", flush=True)


if __name__ == "__main__":
    main([int(c) for c in sys.argv[1:]] or [90])
