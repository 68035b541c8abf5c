"""A long prefill beside a neighbour: two threads with whole products, one thread, two threads
with products split by rows handed out as threads come free (prefixkv/model/row_split.py), and the
adaptive policy (prefixkv/engine/cpu_threads.py: split products and the `LayerProbe` between the
two counts), alternating in one process.

Beside a neighbour keeping 70% of one of two cores busy, two threads prefill faster than one;
beside one keeping a whole core busy, slower - and /proc/stat shows the two neighbours alike. The
adaptive policy therefore times a long step's first layers on both counts and runs the rest on the
faster. This script measures whether that choice lands on the faster count, and what the split
buys: one engine, a 761-token prompt (nothing cached) prefilled on a fixed two threads, a fixed one
thread, two threads split, and under the adaptive policy, in turn, `--reps` times (`--burst`
prefills in a row each), beside a neighbour of `--load` cores (0: alone; the neighbour is
bench/contention.py's 10 ms duty-cycle loop). Prints the medians, each run, and what each probe
measured (ms of its timed layers on each count) and chose.

    .venv/bin/python bench/prefill_threads.py [--dtype bfloat16] [--load 1.0] [--reps 8] [--burst 1]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import torch  # noqa: E402

from bench.contention import NEIGHBOUR  # noqa: E402
from prefixkv import LLM, SamplingParams  # noqa: E402
from prefixkv.engine import cpu_threads  # noqa: E402
from prefixkv.model import row_split  # noqa: E402

WORDS = "river mountain quiet engine paper lantern violet harbor copper signal garden winter".split()


def text(n: int, seed: int) -> str:
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(n))


class RecordingProbe(cpu_threads.LayerProbe):
    """The engine's probe, keeping what each one measured and chose."""

    log: list[tuple[float, float, int]] = []

    def at_layer(self, index: int, now: float) -> int | None:
        threads = super().at_layer(index, now)
        if index == self.decide_at and self.chosen is not None:
            self.log.append((self.spent[0] * 1e3, self.spent[1] * 1e3, self.chosen))
        return threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--load", type=float, default=1.0, help="fraction of one core the neighbour keeps busy (0: none)")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument(
        "--burst", type=int, default=1, help="prefills in a row per mode and rep (the policy reuses its evidence)"
    )
    args = ap.parse_args()
    cpu_threads.LayerProbe = RecordingProbe  # type: ignore[misc]
    configured = torch.get_num_threads()
    llm = LLM(enable_prefix_caching=False, max_model_len=2048, dtype=args.dtype)  # adaptive: the default
    engine = llm.llm_engine
    adaptive = engine.cpu_threads
    if adaptive is None:
        sys.exit("no adaptive thread policy here (no /proc/stat, or not a CPU engine)")
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate(["warm up"], SamplingParams(max_tokens=2), use_tqdm=False)
    neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR, str(args.load)]) if args.load > 0 else None
    # mode -> (fixed thread count, 0: the adaptive policy; products split by rows)
    modes = {f"{configured} threads": (configured, False), "1 thread": (1, False), "adaptive": (0, False)}
    if row_split.available() and configured > 1:
        modes[f"{configured} split"] = (configured, True)
    else:
        print("(row-split products not available here: no split mode, the policy does not split)")
    times: dict[str, list[float]] = {m: [] for m in modes}
    try:
        time.sleep(1.0)  # a full window of the neighbour before the first step
        for rep in range(args.reps):
            for mode, (threads, split) in modes.items():
                engine.cpu_threads = adaptive if threads == 0 else None
                if threads:
                    torch.set_num_threads(threads)
                    row_split.set_active(split)
                for i in range(args.burst):
                    start = time.perf_counter()
                    llm.generate([text(760, rep * args.burst + i)], params, use_tqdm=False)
                    times[mode].append(time.perf_counter() - start)
                torch.set_num_threads(configured)
                row_split.set_active(False)
    finally:
        if neighbour is not None:
            neighbour.kill()
    seen = adaptive.load.cores
    print(
        f"{args.dtype}, neighbour {args.load} cores, {args.reps} reps of {args.burst}; foreign load last seen"
        f" {seen:.2f} cores"
    )
    print(
        f"  adaptive: {adaptive.steps_probed} of its {args.reps * args.burst} steps probed (the rest ran unprobed on"
        f" decisive evidence), {adaptive.steps_row_split} split their products"
    )
    for mode, runs in times.items():
        print(f"  {mode:10s} median {statistics.median(runs):.3f} s  runs {' '.join(f'{r:.2f}' for r in runs)}")
    log = RecordingProbe.log
    chose_one = sum(1 for *_, c in log if c == 1)
    print(f"  probes: {len(log)}, chose 1 thread in {chose_one}; ms of the timed layers on {configured} / 1, chosen:")
    print("   ", ", ".join(f"{a:.0f}/{b:.0f}->{c}" for a, b, c in log))


if __name__ == "__main__":
    main()
