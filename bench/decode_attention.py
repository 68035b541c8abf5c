"""Paged decode attention of one layer: prefixkv's native CPU kernel (csrc/decode_attention.cpp)
against PyTorch's path (gather the context with index_select, then SDPA), at decode batch sizes.

    .venv/bin/python bench/decode_attention.py [--batches 1,8,24,64] [--context 500]
        [--dtypes bfloat16,float32] [--layers 12] [--reps 9] [--threads N]

Each sequence's context lies in blocks of 16 slots scattered over a cache of 4x the slots needed
(as after churn), on huge pages as the engine's caches are; the default model's shapes (9 query
heads on 3 KV heads, head dim 64). A call runs the --layers layers' caches in turn, as a decode step
does, so the context comes from memory, not from a cache that the previous call left warm. Prints
medians per layer, nanoseconds per key and KV head, GB/s of K and V read, the speed-up, and the
largest difference between the outputs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.prefill_attention import median_ms  # noqa: E402
from prefixkv import huge_pages  # noqa: E402
from prefixkv.model.kernels import ops  # noqa: E402

BLOCK = 16


def paged_slots(batch: int, context: int, gen: torch.Generator) -> torch.Tensor:
    blocks_per_seq = -(-context // BLOCK)
    order = torch.randperm(4 * batch * blocks_per_seq, generator=gen)[: batch * blocks_per_seq]
    blocks = order.view(batch, blocks_per_seq)
    slots = (blocks[:, :, None] * BLOCK + torch.arange(BLOCK)).view(batch, -1)[:, :context]
    return slots.contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,24,64")
    ap.add_argument("--context", type=int, default=500)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--heads", default="9,3", help="query heads, KV heads")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=12, help="caches called in turn (the model has 30)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.context < 1 or args.layers < 1 or args.reps < 1:
        sys.exit("--context, --layers and --reps must be at least 1")
    hq, hkv = map(int, args.heads.split(","))
    d = args.head_dim
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}")
    print(f"context {args.context} keys, {hq} query heads on {hkv} KV heads, head dim {d}")
    print(
        f"{'dtype':>9} {'batch':>5} {'native us':>10} {'ns/key*head':>11} {'GB/s':>6} {'torch us':>9}"
        f" {'speed-up':>8} {'max diff':>9}"
    )
    gen = torch.Generator().manual_seed(0)
    for name in args.dtypes.split(","):
        for batch in map(int, args.batches.split(",")):
            measure(getattr(torch, name), batch, hq, hkv, d, args, gen)


def cache(values: torch.Tensor) -> torch.Tensor:
    """The values in a cache on huge pages where the system allows, as the engine allocates its
    K/V caches (on 4 KiB pages a scattered block costs a TLB miss the engine does not pay)."""
    out = huge_pages.zeros(tuple(values.shape), values.dtype)
    out.copy_(values)
    return out


def measure(dtype: torch.dtype, batch: int, hq: int, hkv: int, d: int, args: argparse.Namespace, gen) -> None:
    slots = paged_slots(batch, args.context, gen)
    num_slots = 4 * batch * (-(-args.context // BLOCK)) * BLOCK
    ks = [cache(torch.randn(num_slots, hkv, d, generator=gen).to(dtype)) for _ in range(args.layers)]
    vs = [cache(torch.randn(num_slots, hkv, d, generator=gen).to(dtype)) for _ in range(args.layers)]
    q = torch.randn(batch, hq, d, generator=gen).to(dtype)
    lens = torch.full((batch,), args.context, dtype=torch.int64)
    scale = d**-0.5

    def native(layer: int):
        return ops.decode_attention(q, ks[layer], vs[layer], slots, lens, scale)

    def reference(layer: int):
        k, v = ks[layer], vs[layer]
        kc = k.index_select(0, slots.view(-1)).view(batch, args.context, hkv, d).transpose(1, 2)
        vc = v.index_select(0, slots.view(-1)).view(batch, args.context, hkv, d).transpose(1, 2)
        return F.scaled_dot_product_attention(q.unsqueeze(2), kc, vc, scale=scale, enable_gqa=True).squeeze(2)

    out = native(0)
    if out is None:
        sys.exit("the native decode kernel does not run here (no compiler, or turned off)")
    diff = (out.float() - reference(0).float()).abs().max().item()
    t_native = median_ms(lambda: [native(i) for i in range(args.layers)], args.reps) * 1e3 / args.layers
    t_torch = median_ms(lambda: [reference(i) for i in range(args.layers)], args.reps) * 1e3 / args.layers
    keys = batch * args.context * hkv
    gbps = 2 * keys * d * q.element_size() / t_native / 1e3
    name = str(dtype).removeprefix("torch.")
    print(
        f"{name:>9} {batch:>5} {t_native:>10.1f} {t_native * 1e3 / keys:>11.2f} {gbps:>6.1f}"
        f" {t_torch:>9.1f} {t_torch / t_native:>7.2f}x {diff:>9.2e}"
    )


if __name__ == "__main__":
    main()
