"""One bfloat16 linear at decode-sized row counts: oneDNN's packed kernel (PackedLinear) against the
native small-batch kernel (prefixkv/model/csrc/small_linear.cpp, what DualLayoutLinear runs for up
to 8 rows where the CPU has AVX512-BF16), on the default model's four layer shapes and its head.

Each timed call uses the next of 30 copies of the weight (4 of the head), so the weights stream
from memory as they do layer after layer in the model, not from cache. Medians of --reps rounds of
--calls calls each, the two kernels alternated round by round; GB/s = weight bytes / time.

    .venv/bin/python bench/small_linear.py --rows 1,2,4,8,16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from prefixkv.model import cpu_kernels  # noqa: E402
from prefixkv.model.layers import PackedLinear  # noqa: E402

# (name, out features, in features) of the default model (SmolLM2-135M)
SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536), ("head", 49152, 576)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_kernels.small_linear_available():
        sys.exit("the native small-batch kernel does not run here (no AVX512-BF16, or the kernels are off)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}")
    g = torch.Generator().manual_seed(0)
    for name, N, K in SHAPES:
        copies = [torch.randn(N, K, generator=g).to(torch.bfloat16) for _ in range(4 if N > 10_000 else 30)]
        onednn = [PackedLinear(w) for w in copies]
        native = [cpu_kernels.small_linear_weight(w) for w in copies]
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, K, generator=g).to(torch.bfloat16)
            kernels = {
                "oneDNN": lambda i, x=x, onednn=onednn: onednn[i](x),
                "native": lambda i, x=x, native=native, N=N: cpu_kernels.small_linear(x, native[i], N),
            }
            times: dict[str, list[float]] = {k: [] for k in kernels}
            for _ in range(args.reps):
                for kname, fn in kernels.items():
                    for i in range(len(copies)):  # warm-up: touch each copy once
                        fn(i)
                    t0 = time.perf_counter()
                    for c in range(args.calls):
                        fn(c % len(copies))
                    times[kname].append((time.perf_counter() - t0) / args.calls)
            a, b = statistics.median(times["oneDNN"]), statistics.median(times["native"])
            print(
                f"{name:8s} {N:5d} x {K:4d}  rows {rows:2d}: oneDNN {a * 1e6:7.1f} us ({N * K * 2 / a / 1e9:5.1f} GB/s)"
                f"  native {b * 1e6:7.1f} us ({N * K * 2 / b / 1e9:5.1f} GB/s)  {a / b:4.2f}x"
            )
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
