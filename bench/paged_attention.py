"""One layer's paged attention through `model/attention.paged_attention`, the context read by
Triton's kernels in place (PREFIXKV_CUDA_ATTENTION=triton) against the gather path (the context
copied through the block tables, then PyTorch's attention), at decode and at prefill after cached
context.

    python3 bench/paged_attention.py --device cuda [--dtype bfloat16] [--batches 1,32,256]
        [--contexts 1024,8192] [--new 64] [--heads 9,3] [--head-dim 64] [--reps 20]
    # a CPU smoke of the same code under Triton's interpreter (tiny shapes):
    TRITON_INTERPRET=1 python3 bench/paged_attention.py --device cpu --dtype float32 \\
        --batches 1,2 --contexts 40 --new 5 --heads 4,2 --head-dim 16 --reps 1

Each sequence's context lies in blocks of 16 slots scattered over the cache (as after churn), no
two sequences sharing one (no cascade: each reads its whole context) unless --shared N: then every
sequence's first N tokens are the same blocks, which both paths attend to once (the cascade) before
each sequence's own suffix. `decode`: one new token a
sequence; `prefill`: --new tokens a sequence after its context. A call writes the step's K/V and
attends, as a layer does; the step's plan (index tensors) is built once before timing, as for a
model's every layer after its first. Prints medians (ms) of each path, the speed-up, and the
largest difference between the two outputs. On a CPU the path beside Triton's is the CPU's own
(its native kernels), not the gather.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.arg_types import ints  # noqa: E402
from prefixkv.model.attention import AttentionMetadata, paged_attention  # noqa: E402
from prefixkv.model.attention_path import ENV  # noqa: E402

BLOCK = 16


def median_ms(fn, reps: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def case(batch: int, context: int, new: int, shared: int, hq: int, hkv: int, d: int, dtype: torch.dtype, device: str):
    """The step's tensors: q/k/v of the new tokens, a layer's cache, and the step's metadata."""
    g = torch.Generator().manual_seed(batch * 7 + context)
    total = context + new
    per_seq = -(-total // BLOCK)
    common = shared // BLOCK
    num_blocks = batch * (per_seq - common) + common + 1
    pool = torch.randperm(num_blocks, generator=g)
    own = pool[common : common + batch * (per_seq - common)].view(batch, per_seq - common)
    order = torch.cat([pool[:common].expand(batch, common), own], dim=1)
    cache = torch.randn(2, num_blocks, BLOCK, hkv, d, generator=g).to(dtype).to(device)
    pos = torch.arange(context, total)
    slots = (order[:, pos // BLOCK] * BLOCK + pos % BLOCK).reshape(-1)
    rows = batch * new
    q, k, v = (torch.randn(rows, h, d, generator=g).to(dtype).to(device) for h in (hq, hkv, hkv))
    qsl = [i * new for i in range(batch + 1)]

    def meta() -> AttentionMetadata:
        return AttentionMetadata(slots.to(device), qsl, [total] * batch, order.to(device))

    return q, k, v, cache, meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", type=ints, default=[1, 32, 256])
    ap.add_argument("--contexts", type=ints, default=[1024, 8192])
    ap.add_argument("--new", type=int, default=64, help="new tokens a sequence at prefill")
    ap.add_argument("--shared", type=int, default=0, help="leading context tokens every sequence shares")
    ap.add_argument("--kinds", default="decode,prefill")
    ap.add_argument("--heads", default="9,3", help="query heads, KV heads (the default model's)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    hq, hkv = (int(x) for x in args.heads.split(","))
    device = args.device
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    print(
        f"# {name}, {args.dtype}, {hq} query heads on {hkv} KV heads of {args.head_dim}, blocks of {BLOCK}, "
        f"{args.shared} context tokens shared"
    )
    print("| kind | batch | context | gather ms | triton ms | speed-up | max diff |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kind in args.kinds.split(","):
        new = 1 if kind == "decode" else args.new
        for context in args.contexts:
            for batch in args.batches:
                try:
                    q, k, v, cache, meta = case(batch, context, new, args.shared, hq, hkv, args.head_dim, dtype, device)
                    ms, outs = {}, {}
                    for path in ("gather", "triton"):
                        os.environ[ENV] = path
                        m = meta()
                        outs[path] = paged_attention(q, k, v, cache, m)  # builds the plan
                        ms[path] = median_ms(partial(paged_attention, q, k, v, cache, m), args.reps, sync)
                    diff = (outs["gather"].float() - outs["triton"].float()).abs().max().item()
                    speed = ms["gather"] / ms["triton"]
                    print(
                        f"| {kind} | {batch} | {context} | {ms['gather']:.3f} | {ms['triton']:.3f} | "
                        f"{speed:.2f}x | {diff:.1e} |",
                        flush=True,
                    )
                except torch.OutOfMemoryError:
                    print(f"| {kind} | {batch} | {context} | out of memory | | | |", flush=True)
                q = k = v = cache = outs = None
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
