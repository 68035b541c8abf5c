"""Whether a batch-1 decode's small kernels can fold into its matrix-vector products on this card:
the step before a product done in the product's own Triton kernel, against the engine's path (the
fused Triton step, then `F.linear`: cuBLAS) and against `F.linear` alone, at the products of a
decode layer. The steps folded in: the residual add and RMSNorm before q/k/v and before gate/up
(`add_rms_norm`: every program sums its row's squares itself; one writes the new residual) and
SiLU-and-multiply before down (`silu_and_mul`), each rounded where the engine's kernel rounds it.

On an H200 the Llama-3.2-1B shape's batch-1 step kept the device busy 0.90 ms for 0.49 ms of
weights to read (docs/benchmarks.md, "Current figures: an H200"): besides its 64 products each
layer runs five small kernels of a few microseconds (two norms, the rotation and cache write, the
attention, SiLU-and-multiply). Three of them could fold into a product; this measures what that
costs and saves before the engine takes it.

    python3 bench/fused_gemv.py [--shapes llama-1b,smollm2] [--reps 20]
    # a CPU smoke of the same kernel under Triton's interpreter (tiny shapes, no timing):
    TRITON_INTERPRET=1 python3 bench/fused_gemv.py --device cpu --shapes tiny

The fused kernel is the engine's (model/kernels/triton_gemv.py, which the engine times against its
layer by layer path on the card at start-up: cuda_graphs.StepGraphs._choose_one_row): with the
engine's block shape, and with the block shape Triton's autotuner picks here (printed: what the
engine's BLOCK_N and BLOCK_K could be). Each variant is captured 50 times in a CUDA graph and
replayed, timed with CUDA events: device time per call, no launch cost. Prints each product's
microseconds, the share of the measured bandwidth its weight read reaches, and the fused kernel's
largest difference from the engine's path (bfloat16).
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.arg_types import names  # noqa: E402
from bench.machine import describe  # noqa: E402
from prefixkv.model.kernels import gpu_fused  # noqa: E402
from prefixkv.model.kernels import triton_gemv as tg  # noqa: E402

# (name, out features N, in features K, the step before it: "norm" the residual add and RMSNorm,
# "silu" SiLU-and-multiply of a [2K] gate/up row, "" none): a decode layer's products
SHAPES = {
    "llama-1b": [
        ("qkv", 3072, 2048, "norm"),
        ("o", 2048, 2048, ""),
        ("gate_up", 16384, 2048, "norm"),
        ("down", 2048, 8192, "silu"),
        ("lm_head", 49152, 2048, "norm"),
    ],
    "smollm2": [
        ("qkv", 960, 576, "norm"),
        ("o", 576, 576, ""),
        ("gate_up", 3072, 576, "norm"),
        ("down", 576, 1536, "silu"),
        ("lm_head", 49152, 576, "norm"),
    ],
    "tiny": [("qkv", 48, 32, "norm"), ("down", 32, 80, "silu"), ("o", 32, 32, "")],
}
PROLOGUES = {"": 0, "norm": 1, "silu": 2}
CALLS_PER_GRAPH = 50


# on a GPU the block shape is tuned per product (Triton's autotuner times each on the card); the
# interpreter has no device to time on and takes one
CONFIGS = [
    triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w)
    for n in (4, 8, 16, 32)
    for k in (256, 512, 1024)
    for w in (2, 4, 8)
]
_tuned = None


def prologue_gemv(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    tuned: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The engine's kernel (kernels/triton_gemv.py): the product of `weight` [N, K] with x [1, K]
    (no step before it), with RMSNorm(x + delta) by norm_weight (returns the new residual too), or
    with silu(x[:, :K]) * x[:, K:] (x [1, 2K]). `tuned`: Triton's autotuner picks the block shape
    on the card (else the engine's BLOCK_N, BLOCK_K)."""
    global _tuned
    prologue = 1 if norm_weight is not None else 2 if x.shape[-1] == 2 * weight.shape[1] else 0
    kernel = None
    if tuned and x.device.type == "cuda":
        if _tuned is None:
            _tuned = triton.autotune(configs=CONFIGS, key=["N", "K", "PROLOGUE", "HAS_DELTA"])(tg._prologue_gemv_kernel)
        kernel = _tuned
    h_out, out = tg.launch(x, delta, norm_weight, weight, eps, prologue, kernel)
    return out, (h_out if delta is not None else None)


def engine_path(
    x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """The engine's layer by layer path: its fused step (add_rms_norm on a copy of x, silu_and_mul),
    then F.linear."""
    if norm_weight is not None:
        normed = gpu_fused.add_rms_norm(x.clone(), delta, norm_weight, eps)
        assert normed is not None, "the fused kernels are off (PREFIXKV_CUDA_KERNELS=0)"
        x = normed
    elif x.shape[-1] == 2 * weight.shape[1]:
        act = gpu_fused.silu_and_mul(x)
        assert act is not None, "the fused kernels are off (PREFIXKV_CUDA_KERNELS=0)"
        x = act
    return F.linear(x, weight)


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
    ap.add_argument("--shapes", type=names(SHAPES), default=["llama-1b", "smollm2"], help=f"of: {', '.join(SHAPES)}")
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
    if not cuda:
        gpu_fused.run_on_cpu = True  # the engine's kernels under the interpreter too
    for shape in args.shapes:
        for name, n, k, before in SHAPES[shape]:
            x = torch.randn(1, 2 * k if before == "silu" else k, generator=g).to(dtype).to(dev)
            w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(dev)
            norm = before == "norm"
            delta = torch.randn(1, k, generator=g).to(dtype).to(dev) if norm else None
            nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(dev) if norm else None
            want = engine_path(x, delta, nw, w, eps)
            got, h_new = prologue_gemv(x, delta, nw, w, eps)
            diff = (got.float() - want.float()).abs().max().item()
            if h_new is not None and delta is not None:
                assert torch.equal(h_new, (x.float() + delta.float()).to(dtype)), "the new residual"
            step = f"+{before}" if before else ""
            line = f"{shape:9s} {name:8s} {n:6d} x {k:5d} {step:6s}: max |fused - engine| {diff:.2e}"
            if cuda:
                fused = device_us(lambda: prologue_gemv(x, delta, nw, w, eps), args.reps)  # noqa: B023
                tuned = device_us(lambda: prologue_gemv(x, delta, nw, w, eps, tuned=True), args.reps)  # noqa: B023
                best = _tuned.best_config if _tuned is not None else None
                plain = device_us(lambda: engine_path(x, delta, nw, w, eps), args.reps)  # noqa: B023
                linear = device_us(lambda: F.linear(x[:, :k], w), args.reps)  # noqa: B023
                read_us = w.numel() * w.element_size() / bandwidth * 1e6 if bandwidth else float("nan")
                line += (
                    f"; us: fused {fused:7.2f} (the engine's blocks), {tuned:7.2f} (tuned: {best})  "
                    f"engine's layer path {plain:7.2f}  F.linear alone {linear:7.2f}  "
                    f"(the weight's read {read_us:6.2f}: fused at {100 * read_us / min(fused, tuned):3.0f}% of the "
                    f"bandwidth, F.linear at {100 * read_us / linear:3.0f}%)"
                )
            print(line, flush=True)


if __name__ == "__main__":
    main()
