"""Whether a batch-1 decode's small kernels can fold into its matrix-vector products on this card:
an RMSNorm folded into the product after it, in one Triton kernel, against PyTorch's path (the
norm, then `F.linear`: cuBLAS) and against `F.linear` alone, at the products of a decode layer.

On an H200 the Llama-3.2-1B shape's batch-1 step kept the device busy 0.90 ms for 0.49 ms of
weights to read (docs/benchmarks.md, "Current figures: an H200"): besides its 64 products each
layer runs five small kernels of a few microseconds (two norms, the rotation and cache write, the
attention, SiLU-and-multiply). Folding a norm into the product after it is the first of those
fusions; this measures what it costs and saves before the engine takes it.

    python3 bench/fused_gemv.py [--shapes llama-1b,smollm2] [--reps 20]
    # a CPU smoke of the same kernel under Triton's interpreter (tiny shapes, no timing):
    TRITON_INTERPRET=1 python3 bench/fused_gemv.py --device cpu --shapes tiny

Each variant is captured 50 times in a CUDA graph and replayed, timed with CUDA events: device time
per call, no launch cost. Prints each product's microseconds, the share of the measured bandwidth
its weight read reaches, and the fused kernel's largest difference from PyTorch's (bfloat16).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.machine import describe  # noqa: E402

# (name, out features N, in features K, a norm before it): a decode layer's products
SHAPES = {
    "llama-1b": [
        ("qkv", 3072, 2048, True),
        ("o", 2048, 2048, False),
        ("gate_up", 16384, 2048, True),
        ("down", 2048, 8192, False),
        ("lm_head", 49152, 2048, True),
    ],
    "smollm2": [
        ("qkv", 960, 576, True),
        ("o", 576, 576, False),
        ("gate_up", 3072, 576, True),
        ("down", 576, 1536, False),
        ("lm_head", 49152, 576, True),
    ],
    "tiny": [("qkv", 48, 32, True), ("down", 32, 80, False)],
}
CALLS_PER_GRAPH = 50


@triton.jit
def _norm_gemv_kernel(
    x_ptr, nw_ptr, w_ptr, out_ptr, N, K, eps, NORM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """out[n] = sum_k W[n, k] * x'[k] for BLOCK_N rows n, x' = x, or with NORM x's RMSNorm by nw
    (normalized in float32, rounded to x's dtype, then scaled, as transformers does); each program
    computes the norm's sum of squares itself (K values from L2: cheap beside its rows of W)."""
    pid = tl.program_id(0)
    ns = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    inv = 1.0
    if NORM:
        squares = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            xs = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
            squares += xs * xs
        inv = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + ks, mask=k_ok, other=0.0)
        if NORM:
            nw = tl.load(nw_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            x = ((x.to(tl.float32) * inv).to(x.dtype).to(tl.float32) * nw).to(x.dtype)
        w = tl.load(w_ptr + ns[:, None] * K + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(out_ptr + ns, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=n_ok)


# on a GPU the block shape is tuned per product (Triton's autotuner times each on the card); the
# interpreter has no device to time on and takes one
CONFIGS = [
    triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w)
    for n in (4, 8, 16, 32)
    for k in (256, 512, 1024)
    for w in (2, 4, 8)
]
_tuned = None


def norm_gemv(x: torch.Tensor, norm_weight: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [K] -> [N]: (RMSNorm(x) if norm_weight is given, else x) @ weight.T, one kernel."""
    global _tuned
    N, K = weight.shape
    out = torch.empty(N, dtype=x.dtype, device=x.device)
    nw = norm_weight if norm_weight is not None else x
    if x.device.type != "cuda":
        _norm_gemv_kernel[(triton.cdiv(N, 8),)](
            x, nw, weight, out, N, K, eps, NORM=norm_weight is not None, BLOCK_N=8, BLOCK_K=256
        )
        return out
    if _tuned is None:
        _tuned = triton.autotune(configs=CONFIGS, key=["N", "K", "NORM"])(_norm_gemv_kernel)
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    _tuned[grid](x, nw, weight, out, N, K, eps, NORM=norm_weight is not None)
    return out


def torch_path(x: torch.Tensor, norm_weight: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if norm_weight is not None:
        xf = x.float()
        x = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * norm_weight
    return F.linear(x[None], weight)[0]


def device_us(fn: Callable[[], object], reps: int) -> float:
    """Median over `reps` replays of a graph of CALLS_PER_GRAPH calls, microseconds a call."""
    for _ in range(3):
        fn()  # autotuning and compiling happen here, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS_PER_GRAPH)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default="llama-1b,smollm2", help=f"of: {', '.join(SHAPES)}")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    print(describe(), flush=True)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    bandwidth = None
    if cuda:
        from bench.ceiling import measure_cuda

        bandwidth = measure_cuda((dtype,), args.device).bytes_per_s
        print(f"{torch.cuda.get_device_name()}: reads {bandwidth / 1e9:.0f} GB/s measured now", flush=True)
    g = torch.Generator().manual_seed(0)
    eps = 1e-5
    for shape in args.shapes.split(","):
        for name, n, k, norm in SHAPES[shape]:
            x = torch.randn(k, generator=g).to(dtype).to(dev)
            w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(dev)
            nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(dev) if norm else None
            want = torch_path(x, nw, w, eps)
            got = norm_gemv(x, nw, w, eps)
            diff = (got.float() - want.float()).abs().max().item()
            line = (
                f"{shape:9s} {name:8s} {n:6d} x {k:5d}{' +norm' if norm else '      '}: max |fused - torch| {diff:.2e}"
            )
            if cuda:
                fused = device_us(lambda: norm_gemv(x, nw, w, eps), args.reps)  # noqa: B023
                plain = device_us(lambda: torch_path(x, nw, w, eps), args.reps)  # noqa: B023
                linear = device_us(lambda: F.linear(x[None], w), args.reps)  # noqa: B023
                read_us = w.numel() * w.element_size() / bandwidth * 1e6 if bandwidth else float("nan")
                line += (
                    f"; us: fused {fused:7.2f}  torch {plain:7.2f}  F.linear alone {linear:7.2f}  "
                    f"(the weight's read {read_us:6.2f}: fused at {100 * read_us / fused:3.0f}% of the bandwidth, "
                    f"F.linear at {100 * read_us / linear:3.0f}%)"
                )
            print(line, flush=True)


if __name__ == "__main__":
    main()
