"""Why `prefixkv serve` keeps the engine loop on the main thread: the same torch ops timed on the
main thread and on a thread started after the main thread has used torch.

    .venv/bin/python bench/thread_overhead.py [--reps 500]

Prints the median-of-5 microseconds per op for each (docs/serving.md quotes one run).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch


def timings(reps: int) -> dict[str, float]:
    big = torch.randn(256, 576)
    w = torch.randn(1536, 576, dtype=torch.bfloat16)
    x = torch.randn(4, 576, dtype=torch.bfloat16)
    ops = {
        "x + 1 (256x576 fp32)": lambda: big + 1,
        "linear 4x576 @ 576x1536 (bf16)": lambda: torch.nn.functional.linear(x, w),
    }
    out = {}
    for name, fn in ops.items():
        for _ in range(20):
            fn()
        runs = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            runs.append((time.perf_counter() - t) / reps * 1e6)
        out[name] = statistics.median(runs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=500)
    args = ap.parse_args()
    main_t = timings(args.reps)
    box: dict = {}
    th = threading.Thread(target=lambda: box.update(timings(args.reps)))
    th.start()
    th.join()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in main_t:
        print(
            f"{name:34s} main thread {main_t[name]:8.1f} us   later thread {box[name]:8.1f} us   "
            f"x{box[name] / main_t[name]:.1f}"
        )


if __name__ == "__main__":
    main()
