"""Prefix-cache hit rate against cache size on a request trace, per eviction policy.

    .venv/bin/python bench/hit_rate.py [--trace examples/traces/conversation_sample.jsonl]
        [--num-blocks 1000,1500,2000,3000,4000,6000,8000] [--policy lru,predicted-reuse] [--plot-dir DIR]

Runs `prefixkv replay --json` (the real cache manager; docs/replay.md) once per cache size, with
Belady's offline optimum beside the policies, prints one row per size and, with --plot-dir, writes
DIR/hit_rate_vs_cache_size.png. The default trace is the 500-request Mooncake sample shipped in
examples/traces/ (seconds); the full traces (examples/traces/README.md says where they come from)
take minutes: bench/replay.py sweeps them.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.machine import describe  # noqa: E402
from bench.plots import line_chart  # noqa: E402

DEFAULT_TRACE = "examples/traces/conversation_sample.jsonl"


def replay(trace: str, num_blocks: int, policies: str) -> tuple[dict[str, float], float | None]:
    """Hit rate per policy (and 'optimum') at one cache size, and the infinite-cache ceiling."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefixkv.cli",
            "replay",
            trace,
            "--num-blocks",
            str(num_blocks),
            "--policy",
            policies,
            "--optimum",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    rates, ceiling = {}, None
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            rates[row["policy"]] = row["hit_rate"]
        elif m := re.search(r"infinite-cache ceiling: ([\d.]+)%", line):
            ceiling = float(m.group(1)) / 100
    return rates, ceiling


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=DEFAULT_TRACE)
    ap.add_argument("--num-blocks", default="1000,1500,2000,3000,4000,6000,8000", help="cache sizes in blocks")
    ap.add_argument("--policy", default="lru,predicted-reuse", help="eviction policies (prefixkv replay --policy)")
    ap.add_argument("--plot-dir", help="write hit_rate_vs_cache_size.png there (make bench: docs/figures)")
    args = ap.parse_args()
    print(describe(), flush=True)
    sizes = [int(n) for n in args.num_blocks.split(",")]
    print(f"hit rate vs cache size: {args.trace}, block size 512 (the trace's)")
    series: dict[str, list[float]] = {}
    ceiling = None
    for i, n in enumerate(sizes):
        print(f"  ... {n} blocks ({i + 1}/{len(sizes)})", flush=True)
        rates, ceiling = replay(args.trace, n, args.policy)
        for name, rate in rates.items():
            series.setdefault(name, []).append(rate)
    names = list(series)
    print("  " + f"{'blocks':>8} " + " ".join(f"{name:>16}" for name in names))
    for i, n in enumerate(sizes):
        print("  " + f"{n:>8} " + " ".join(f"{series[name][i]:>15.2%} " for name in names))
    if ceiling is not None:
        print(f"  infinite-cache ceiling {ceiling:.2%}")
        series["infinite cache"] = [ceiling] * len(sizes)
    if args.plot_dir:
        line_chart(
            Path(args.plot_dir) / "hit_rate_vs_cache_size.png",
            f"Prefix-cache hit rate vs cache size: {Path(args.trace).name}",
            sizes,
            series,
            "cache size (blocks of 512 tokens)",
            "token hit rate",
            percent=True,
            note="prefixkv replay: the real KVCacheManager; optimum = Belady's offline bound",
        )


if __name__ == "__main__":
    main()
