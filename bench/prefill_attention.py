"""Causal prefill attention of one layer: prefixkv's native CPU kernel against PyTorch's SDPA.

    .venv/bin/python bench/prefill_attention.py [--lengths 128,478,1024,2048] [--dtypes float32,bfloat16]
        [--heads 9,3] [--head-dim 64] [--reps 9] [--threads N]

One prompt of each length attends to itself, the default model's shapes (9 query heads on 3 KV
heads, head dim 64). The native kernel (prefixkv/model/kernels/ops.py) reads K and V in place
from a paged cache through scattered slots, as the engine calls it; SDPA gets the contiguous K/V
(is_causal, GQA), as the PyTorch path runs a prompt without cached context. Prints medians per
call, the FLOP/s each reaches (2 x 2 x heads x head dim x causal pairs), the speed-up, and the
largest difference between the two outputs. For bfloat16 it says what the kernel multiplies on
here: the tile unit (AMX), vector dot products (AVX512-BF16) or float32 vectors.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from prefixkv.model.kernels import ops  # noqa: E402


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def measure(
    dtype: torch.dtype, n: int, Hq: int, Hkv: int, D: int, reps: int, g: torch.Generator
) -> tuple[float, float, float]:
    """(native ms, SDPA ms, largest difference of their outputs) for one n-token prompt."""
    q = torch.randn(n, Hq, D, generator=g).to(dtype)
    k = torch.randn(n, Hkv, D, generator=g).to(dtype)
    v = torch.randn(n, Hkv, D, generator=g).to(dtype)
    num_slots = 2 * n + 64
    slots = torch.randperm(num_slots, generator=g)[:n]  # scattered, as blocks of a busy pool
    k_flat = torch.zeros(num_slots, Hkv, D, dtype=dtype)
    v_flat = torch.zeros_like(k_flat)
    k_flat[slots], v_flat[slots] = k, v
    seqs = torch.tensor([[0, n, n, 0]])
    out = torch.empty_like(q)

    def native() -> None:
        assert ops.prefill_attention(q, k_flat, v_flat, seqs, slots, D**-0.5, out)

    def sdpa() -> torch.Tensor:
        qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k, v))
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)[0].transpose(0, 1)

    ours, theirs = median_ms(native, reps), median_ms(sdpa, reps)
    return ours, theirs, (out.float() - sdpa().float()).abs().max().item()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="128,478,1024,2048")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--heads", default="9,3", help="query heads, KV heads")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not ops.available():
        print("the native CPU kernels are not available here (no compiler?): nothing to compare")
        return 1
    Hq, Hkv = (int(x) for x in args.heads.split(","))
    D = args.head_dim
    print(
        f"load average {os.getloadavg()[0]:.2f}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"{Hq} query heads on {Hkv} KV heads, head dim {D}"
    )
    g = torch.Generator().manual_seed(0)
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        unit = ""
        if dtype == torch.bfloat16:
            unit = {"amx": " (tile unit, AMX)", "dot": " (dot products, AVX512-BF16)", "vectors": " (vectors)"}[
                ops.bf16_prefill_attention_unit()
            ]
        for n in (int(x) for x in args.lengths.split(",")):
            ours, theirs, diff = measure(dtype, n, Hq, Hkv, D, args.reps, g)
            flops = 2 * 2 * Hq * D * n * (n + 1) / 2
            print(
                f"{name}{unit} {n:5d} tokens: native {ours:7.3f} ms ({flops / ours / 1e6:4.0f} GFLOP/s) | "
                f"SDPA {theirs:7.3f} ms ({flops / theirs / 1e6:4.0f} GFLOP/s) | "
                f"speed-up {theirs / ours:4.2f}x | max |diff| {diff:.1e}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
