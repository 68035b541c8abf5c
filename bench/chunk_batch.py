"""A step of requests behind one cached prefix, on the PyTorch attention path (CUDA's; on a CPU
with the native kernels off): their chunks in one padded attention a layer (`_ChunkBatch`) against
one attention each, alternated. Prints the step's median time and its operator count (each one a
kernel launch or more on a GPU, where such a step is bound by the host's launches).

    .venv/bin/python bench/chunk_batch.py [--requests 31] [--prefix 1600] [--suffix 60] [--reps 5]
        [--device cpu|cuda] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prefixkv.memory.block_tensors import allocate_kv_cache  # noqa: E402
from prefixkv.model import load_model  # noqa: E402
from prefixkv.model.attention import _ChunkBatch  # noqa: E402
from prefixkv.model.kernels import ops  # noqa: E402
from tests.model.model_helpers import make_step  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=31)
    ap.add_argument("--prefix", type=int, default=1600)
    ap.add_argument("--suffix", type=int, default=60)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    lm = load_model(None, dtype=dtype, device=args.device)
    model, bs = lm.model, 16
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(100, 5000, (args.prefix,), generator=g).tolist()
    pre_blocks = list(range((args.prefix + bs - 1) // bs))
    per = (args.suffix + bs) // bs + 1
    seqs = []
    for r in range(args.requests):
        own = [len(pre_blocks) + r * per + j for j in range(per)]
        toks = prefix + torch.randint(100, 5000, (args.suffix + r % 7,), generator=g).tolist()
        seqs.append((toks, pre_blocks + own, args.prefix))
    caches = allocate_kv_cache(lm.config, len(pre_blocks) + args.requests * per, bs, dtype=dtype, device=args.device)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    small, most = _ChunkBatch.SMALL_PADDED_WORK, _ChunkBatch.MAX_PADDED_WORK

    def step(batched: bool):
        _ChunkBatch.SMALL_PADDED_WORK, _ChunkBatch.MAX_PADDED_WORK = (small, most) if batched else (0, 0.0)
        ids, pos, meta = make_step(seqs, bs)
        with ops.disabled(), torch.inference_mode():
            out = model(ids, pos, caches, meta)
        _ChunkBatch.SMALL_PADDED_WORK, _ChunkBatch.MAX_PADDED_WORK = small, most
        return out

    with ops.disabled(), torch.inference_mode():  # the prefix once, into the shared blocks
        ids, pos, meta = make_step([(prefix, pre_blocks, 0)], bs)
        model(ids, pos, caches, meta)
    outs = {mode: step(mode) for mode in (True, False)}
    diff = (outs[True].float() - outs[False].float()).abs().max().item()
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.reps):
        for mode in (True, False):
            sync()
            t = time.perf_counter()
            step(mode)
            sync()
            times[mode].append(time.perf_counter() - t)
    aten = {}
    for mode in (True, False):
        with torch.profiler.profile() as p:
            step(mode)
        aten[mode] = sum(e.count for e in p.key_averages() if e.key.startswith("aten::"))
    print(
        f"{args.requests} requests x ~{args.suffix} new tokens behind a {args.prefix}-token cached prefix, "
        f"{args.device}, {args.dtype}, PyTorch attention path; medians of {args.reps}"
    )
    for mode, name in ((True, "one padded attention"), (False, "one attention a chunk")):
        print(f"  {name:22s}: {statistics.median(times[mode]) * 1e3:8.1f} ms a step, {aten[mode]:6d} aten operators")
    print(f"  largest difference of the last hidden states: {diff:.2e}")


if __name__ == "__main__":
    main()
