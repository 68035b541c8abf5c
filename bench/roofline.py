"""This machine's ceiling: float32 and bfloat16 GEMM FLOP/s and memory bandwidth, as medians.

    .venv/bin/python bench/roofline.py [--threads N] [--repeats R]

GEMMs: F.linear at the default model's prefill shapes (1,024 tokens through its fused q/k/v, o,
fused gate/up and down projections) and torch.mm on two 2,048 x 2,048 matrices; the ceiling of a
dtype is the best of them. Bandwidth: a sum over a 1 GiB buffer (read) and a copy of it (read +
write). The model benchmarks (bench/model_speed.py, bench/serve.py, bench/shared_prefix.py) measure
the same figures with bench/ceiling.py and print their fraction of them. Also prints, for the default
model, what a 1,024-token prefill and a decode step would take at the ceiling.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.ceiling import decode_bytes, measure, prefill_flops  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--repeats", type=int, default=3, help="whole measurements; the median of each figure is printed")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}")
    runs = [measure() for _ in range(args.repeats)]
    c = runs[0]
    for name in c.flops:  # medians across the repeats, figure by figure
        for shape in c.shape_flops[name]:
            c.shape_flops[name][shape] = sorted(r.shape_flops[name][shape] for r in runs)[len(runs) // 2]
        c.flops[name] = max(c.shape_flops[name].values())
    c.read_bytes_per_s = sorted(r.read_bytes_per_s for r in runs)[len(runs) // 2]
    c.copy_bytes_per_s = sorted(r.copy_bytes_per_s for r in runs)[len(runs) // 2]
    print(f"medians of {args.repeats} measurements:")
    for line in c.lines():
        print("  " + line)

    from prefixkv.model import load_model

    cfg = load_model(None).config
    flops = prefill_flops(cfg, 1024)
    print(f"default model ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}) at the ceiling:")
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        best = flops / c.flops[name]
        step = decode_bytes(cfg, dtype, 1, 256) / c.bytes_per_s
        print(
            f"  {name:8s} prefill 1,024 tokens: {flops / 1e9:.0f} GFLOP -> {best * 1000:.0f} ms "
            f"({1024 / best:.0f} tok/s); decode batch 1, 256 context: "
            f"{decode_bytes(cfg, dtype, 1, 256) / 1e6:.0f} MB -> {step * 1000:.1f} ms/step"
        )
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
