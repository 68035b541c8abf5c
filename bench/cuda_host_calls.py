"""What the host pays for each CUDA call a replayed decode step makes, on the machine at hand: the
page-locked staging of its inputs, their copies, the copy of the draws back with an event, a kernel
launch, a graph's replay by its node count. On an H200 the engine's decode step took about 0.9 ms
at batch 1 whatever the model, with the device busy 0.06 ms for a two-layer one
(docs/benchmarks.md, "Current figures: an H200"); a CPU runs the same Python in about a third of
that, so the rest is here.

    python3 bench/cuda_host_calls.py [--batches 1,256] [--reps 7] [--iters 200] [--vocab 49152]

Each figure is the median over --reps of the mean over --iters calls, in microseconds of host time
(the device is synchronized outside the timed calls, except where the call itself waits). Two
ways of staging a step's inputs and reading its draws are timed side by side:
- "per step" (what engine/cuda_graphs.py and model/host_copy.py do now): `Tensor.pin_memory()` of
  each host tensor, `torch.empty(pin_memory=True)` for each draw tensor and a new `torch.cuda.Event`;
- "persistent" (vLLM's staging buffers): page-locked buffers allocated once, written through NumPy
  views, and one event re-recorded.
Without CUDA it says so and exits.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.arg_types import ints  # noqa: E402
from bench.machine import describe  # noqa: E402


def timed(fn: Callable[[], object], reps: int, iters: int, sync: bool = True) -> float:
    """Median over `reps` of the mean host time of `iters` calls of `fn`, in microseconds."""
    means = []
    for _ in range(reps):
        if sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        means.append((time.perf_counter() - start) / iters * 1e6)
    if sync:
        torch.cuda.synchronize()
    return statistics.median(means)


def graph_of(kernels: int, x: torch.Tensor) -> torch.cuda.CUDAGraph:
    """A captured graph of `kernels` tiny in-place additions (the node count is what a replay's
    host cost may grow with)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(kernels):
            x.add_(1)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(kernels):
            x.add_(1)
    return graph


def batch_calls(b: int, width: int, vocab: int, reps: int, iters: int, dev: torch.device) -> None:
    """One batch's staging and reading, both ways, and its greedy sampling's calls."""
    rows = np.zeros((3, b), dtype=np.int64)
    lens = np.zeros(b, dtype=np.int32)
    tables = np.zeros((b, width), dtype=np.int32)
    arrays: list[np.ndarray] = [rows, lens, tables]
    host = [torch.from_numpy(a) for a in arrays]
    bufs = [torch.zeros(a.shape, dtype=a.dtype, device=dev) for a in host]
    staged = [torch.empty(a.shape, dtype=a.dtype, pin_memory=True) for a in host]
    staged_np = [s.numpy() for s in staged]

    def per_step_inputs() -> None:
        for buf, t in zip(bufs, host):
            buf.copy_(t.pin_memory(), non_blocking=True)

    def persistent_inputs() -> None:
        for buf, s, view, a in zip(bufs, staged, staged_np, arrays):
            np.copyto(view, a)
            buf.copy_(s, non_blocking=True)

    tokens = torch.zeros(b, dtype=torch.long, device=dev)
    finite = torch.ones(b, dtype=torch.bool, device=dev)
    out_pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (tokens, finite)]
    event = torch.cuda.Event()

    def per_step_read() -> None:
        pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (tokens, finite)]
        copies = [p.copy_(t, non_blocking=True) for p, t in zip(pinned, (tokens, finite))]
        ev = torch.cuda.Event()
        ev.record()
        ev.synchronize()
        copies[0].tolist()

    def persistent_read() -> None:
        for p, t in zip(out_pinned, (tokens, finite)):
            p.copy_(t, non_blocking=True)
        event.record()
        event.synchronize()
        out_pinned[0].tolist()

    logits = torch.randn(b, vocab, device=dev)

    def greedy() -> None:
        finite_rows = torch.isfinite(logits.sum(dim=-1))
        logits.argmax(dim=-1)
        del finite_rows

    print(f"batch {b}:")
    a, p = timed(per_step_inputs, reps, iters), timed(persistent_inputs, reps, iters)
    print(f"  inputs, three tensors: per step {a:8.1f}, persistent {p:8.1f}")
    a, p = timed(per_step_read, reps, iters), timed(persistent_read, reps, iters)
    print(f"  the draws read back:   per step {a:8.1f}, persistent {p:8.1f} (waits included)")
    print(f"  greedy over [{b}, {vocab}] (sum, isfinite, argmax): {timed(greedy, reps, iters):8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=ints, default=[1, 256])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--vocab", type=int, default=49152, help="the logits' width for the sampling calls")
    ap.add_argument("--width", type=int, default=32, help="block-table columns a row")
    args = ap.parse_args()
    print(describe(), flush=True)
    if not torch.cuda.is_available():
        print("no CUDA device here: nothing to time")
        return
    dev = torch.device("cuda")
    reps, iters = args.reps, args.iters
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; us of host time a call, median of {reps}")
    x = torch.zeros(1, device=dev)
    print(f"  a small kernel's launch (x.add_(1))          {timed(lambda: x.add_(1), reps, iters):8.1f}")
    done = torch.cuda.Event()
    done.record()
    print(f"  Event.synchronize() on a finished event      {timed(done.synchronize, reps, iters):8.1f}")
    print(
        f"  torch.cuda.Event() + record()                {timed(lambda: torch.cuda.Event().record(), reps, iters):8.1f}"
    )
    for kernels in (40, 180, 280):
        graph = graph_of(kernels, x)
        host = timed(graph.replay, reps, 10)  # few: the device must not fall behind the launches
        print(f"  graph.replay(), {kernels:3d} kernels                 {host:8.1f}")
    for b in args.batches:
        batch_calls(b, args.width, args.vocab, reps, iters, dev)


if __name__ == "__main__":
    main()
