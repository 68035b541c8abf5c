"""One soft-capped attention layer (Gemma 2) on the CPU: `paged_attention(softcap=...)` by chunks
of queries (model/explicit_attention.py) against the unchunked explicit softmax (every query of a
sequence against its whole context under an [n, L] mask: n x L scores a head), for a fresh prompt
of --tokens tokens, with and without a sliding window. Each case runs in its own process, --rounds
times, the cases alternated: ms is the median over rounds of the fastest of --reps calls after one
warm-up; peak MiB the memory the first call adds at most (the process's high-water RSS after it,
less before; large allocations mapped and unmapped one by one, MALLOC_MMAP_THRESHOLD_).

    python3 bench/softcap_attention.py [--tokens 512,2048,8192] [--dtypes float32,bfloat16]
        [--windows none,4096] [--chunks 256,1024:19] [--threads 1] [--reps 3] [--rounds 3]
        [--no-plain]

--chunks: the query rows a chunk takes at most (QUERY_CHUNK), and after a colon log2 of the most
scores it may hold (MAX_CHUNK_SCORES); the module's own values where left out.

Default shapes are Gemma 2 2B's layer: 8 query heads, 4 KV heads, head_dim 256, cap 50.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from prefixkv.model import explicit_attention  # noqa: E402
from prefixkv.model.attention import AttentionMetadata, paged_attention  # noqa: E402

BLOCK = 16
CAP = 50.0


def unchunked(q, k_flat, v_flat, seq_len: int, block_table, window: int | None, scale: float) -> torch.Tensor:
    """The explicit softmax over a fresh prompt's whole gathered context under an [n, L] mask."""
    n, Hq, D = q.shape
    Hkv = k_flat.shape[1]
    G = Hq // Hkv
    pos = torch.arange(seq_len)
    slots = block_table[pos // BLOCK] * BLOCK + pos % BLOCK
    mask = pos[None, :] <= pos[:, None]
    if window is not None:
        mask &= pos[:, None] - pos[None, :] < window
    qh = q.view(n, Hkv, G, D).permute(1, 2, 0, 3)
    kc = k_flat.index_select(0, slots).permute(1, 0, 2)[:, None].to(q.dtype)
    vc = v_flat.index_select(0, slots).permute(1, 0, 2)[:, None].to(q.dtype)
    scores = torch.matmul(qh, kc.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / CAP) * CAP
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, vc).permute(2, 0, 1, 3).reshape(n, Hq, D)


def one(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    n, window = args.n, None if args.window == "none" else int(args.window)
    hq, hkv = (int(x) for x in args.heads.split(","))
    D = args.head_dim
    g = torch.Generator().manual_seed(n)
    q = torch.randn(n, hq, D, generator=g).to(dtype)
    k = torch.randn(n, hkv, D, generator=g).to(dtype)
    v = torch.randn(n, hkv, D, generator=g).to(dtype)
    blocks = -(-n // BLOCK)
    table = torch.randperm(blocks, generator=g)
    cache = torch.zeros(2, blocks, BLOCK, hkv, D, dtype=dtype)
    pos = torch.arange(n)
    slots = table[pos // BLOCK] * BLOCK + pos % BLOCK
    scale = D**-0.5
    if args.path == "plain":
        k_flat, v_flat = cache[0].view(-1, hkv, D), cache[1].view(-1, hkv, D)
        k_flat.index_copy_(0, slots, k)
        v_flat.index_copy_(0, slots, v)

        def call() -> torch.Tensor:
            return unchunked(q, k_flat, v_flat, n, table, window, scale)
    else:
        rows, _, budget = args.path.partition(":")
        explicit_attention.QUERY_CHUNK = int(rows)
        if budget:
            explicit_attention.MAX_CHUNK_SCORES = 1 << int(budget)
        meta = AttentionMetadata(slots, [0, n], [n], table[None])

        def call() -> torch.Tensor:
            return paged_attention(q, k, v, cache, meta, scale=scale, window=window, softcap=CAP)

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = call()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    times = []
    for _ in range(args.reps):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return {
        "median_ms": statistics.median(times) * 1e3,
        "min_ms": min(times) * 1e3,
        "peak_mib": peak / 1024,
        "checksum": float(out.float().abs().sum()),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="512,2048,8192")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--windows", default="none,4096")
    p.add_argument("--chunks", default="256")
    p.add_argument("--heads", default="8,4")
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-plain", action="store_true")
    # one case, in this process (what the driver runs)
    p.add_argument("--one", action="store_true")
    p.add_argument("--n", type=int)
    p.add_argument("--dtype")
    p.add_argument("--window")
    p.add_argument("--path")
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args)))
        return
    common = ["--heads", args.heads, "--head-dim", str(args.head_dim), "--threads", str(args.threads)]
    paths = ([] if args.no_plain else ["plain"]) + args.chunks.split(",")
    cases = [
        (n, dtype, window, path)
        for n in (int(x) for x in args.tokens.split(","))
        for dtype in args.dtypes.split(",")
        for window in args.windows.split(",")
        if window == "none" or int(window) < n  # a window as long as the prompt changes nothing
        for path in paths
    ]
    # every large allocation its own mapping, returned when freed: the high-water RSS is then the
    # most memory live at once, not what the allocator's heap kept from earlier sizes
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 17)}
    results: dict[tuple, list[dict]] = {case: [] for case in cases}
    for _ in range(args.rounds):  # rounds alternate the cases, so that a busy moment hits them all
        for case in cases:
            n, dtype, window, path = case
            cmd = [sys.executable, __file__, "--one", "--n", str(n), "--dtype", dtype, "--window", window]
            cmd += ["--path", path, "--reps", str(args.reps), *common]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
            results[case].append(json.loads(out))
    print(
        f"heads {args.heads}, head_dim {args.head_dim}, {args.threads} thread(s), "
        f"{args.rounds} rounds x {args.reps} reps"
    )
    print(f"{'tokens':>6} {'dtype':>8} {'window':>6} {'path':>8} {'ms':>9} {'peak MiB':>9}")
    for case, runs in results.items():
        n, dtype, window, path = case
        ms = statistics.median(r["min_ms"] for r in runs)
        peak = max(r["peak_mib"] for r in runs)
        print(f"{n:>6} {dtype:>8} {window:>6} {path:>8} {ms:>9.1f} {peak:>9.0f}", flush=True)


if __name__ == "__main__":
    main()
