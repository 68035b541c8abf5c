"""One linear at decode-sized row counts: oneDNN's packed kernel (PackedLinear) against the native
small-batch kernel (prefixkv/model/csrc/small_linear.cpp, what DualLayoutLinear runs for a decode
step's few rows where the CPU has AVX512-BF16 / AVX-512, or AVX2 + FMA in float32), on the default
model's four layer shapes and its head; in float32 also F.linear on the plain weight.

Each timed call uses the next of 30 copies of the weight (4 of the head), so the weights stream
from memory as they do layer after layer in the model, not from cache. Medians (or with --fastest,
the fastest) of --reps rounds of --calls calls each, the kernels alternated round by round; GB/s =
weight bytes / time. `--emulate avx2`: as on an AVX2-only CPU (bench/machine.py).

    .venv/bin/python bench/small_linear.py --rows 1,2,4,8,16 [--dtype float32]
    .venv/bin/python bench/small_linear.py --dtype float32 --emulate avx2 --threads 1 --fastest --reps 15
    .venv/bin/python bench/small_linear.py --dtype float32 --sizes 22528x2048,2816x2048 --rows 1,2,8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from bench.machine import EMULATIONS, describe, emulate  # noqa: E402
from prefixkv.model.kernels import ops  # noqa: E402
from prefixkv.model.layers import PackedLinear  # noqa: E402

# (name, out features, in features) of the default model (SmolLM2-135M)
SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536), ("head", 49152, 576)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument(
        "--fastest", action="store_true", help="each kernel's fastest round, not the median (one thread, busy machine)"
    )
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES), help="which of the model's products")
    ap.add_argument("--emulate", choices=sorted(EMULATIONS), help="as on a CPU with only these instructions")
    ap.add_argument(
        "--sizes",
        default="",
        help="out x in products of your own instead (22528x2048,2816x2048: a 1B dense gate/up, a MoE expert's)",
    )
    args = ap.parse_args()
    emulate(args.emulate)
    print(describe(), flush=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if not ops.small_linear_available(dtype):
        sys.exit(f"the native small-batch kernel does not run {args.dtype} here (no AVX-512 / AVX512-BF16, or off)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}")
    g = torch.Generator().manual_seed(0)
    products = [s for s in SHAPES if s[0] in args.shapes.split(",")]
    if args.sizes:
        products = [(size, *map(int, size.split("x"))) for size in args.sizes.split(",")]
    for name, N, K in products:
        copies = [torch.randn(N, K, generator=g).to(dtype) for _ in range(4 if N > 10_000 else 30)]
        onednn = [PackedLinear(w) for w in copies]
        native = [ops.small_linear_weight(w) for w in copies]
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, K, generator=g).to(dtype)
            kernels = {
                "oneDNN": lambda i, x=x, onednn=onednn: onednn[i](x),
                "native": lambda i, x=x, native=native, N=N: ops.small_linear(x, native[i], N),
            }
            if dtype == torch.float32:  # what DualLayoutLinear runs for 1-2 float32 rows
                kernels["F.linear"] = lambda i, x=x, copies=copies: torch.nn.functional.linear(x, copies[i])
            times: dict[str, list[float]] = {k: [] for k in kernels}
            for _ in range(args.reps):
                for kname, fn in kernels.items():
                    for i in range(len(copies)):  # warm-up: touch each copy once
                        fn(i)
                    t0 = time.perf_counter()
                    for c in range(args.calls):
                        fn(c % len(copies))
                    times[kname].append((time.perf_counter() - t0) / args.calls)
            pick = min if args.fastest else statistics.median
            times = {k: [pick(v)] for k, v in times.items()}
            size = N * K * copies[0].element_size()
            cells = "  ".join(
                f"{k} {statistics.median(v) * 1e6:7.1f} us ({size / statistics.median(v) / 1e9:5.1f} GB/s)"
                for k, v in times.items()
            )
            ratio = statistics.median(times["oneDNN"]) / statistics.median(times["native"])
            print(f"{name:8s} {N:5d} x {K:4d}  rows {rows:2d}: {cells}  native vs oneDNN {ratio:4.2f}x")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
