"""Beyond one pool, simulated on the Mooncake traces: a CPU tier below the pool, and N replicas
behind a router. Writes its sections into docs/replay.md (between `<!-- replay_scale:NAME -->`
markers, which bench/replay.py keeps) and the plots docs/replay_tiers_<trace>.png.

    .venv/bin/python bench/replay_scale.py --part tiers --traces-dir DIR
    .venv/bin/python bench/replay_scale.py --part replicas --traces-dir DIR

tiers:    hit rate vs pool size (lru), without a tier and with CPU tiers of --tiers blocks
          (prefixkv replay --cpu-tier-blocks).
replicas: N replicas (--replicas) x routers (prefixkv replay --replicas N --router R): hit rate,
          load imbalance, TTFT estimate (prefixkv/replay/cluster.py).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from prefixkv.replay import TimeModel, load_mooncake, replay  # noqa: E402
from prefixkv.replay.optimum import infinite_cache_hit_rate  # noqa: E402

TRACES = ("conversation", "synthetic")
_STATE: dict = {}


def _trace(path: str, limit: int | None):
    if _STATE.get("key") != (path, limit):
        _STATE.update(key=(path, limit), trace=load_mooncake(path, limit))
    return _STATE["trace"]


def _tier_job(task):
    path, limit, num_blocks, tier = task
    r = replay(_trace(path, limit), num_blocks, 512, "lru", TimeModel(), cpu_tier_blocks=tier)
    return path, num_blocks, tier, r.as_dict()


def splice(md: str, name: str, block: str) -> str:
    """Replace (or append) the section between this part's markers."""
    begin, end = f"<!-- replay_scale:{name} -->", f"<!-- /replay_scale:{name} -->"
    section = f"{begin}\n{block.rstrip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(md):
        return pattern.sub(lambda _: section, md)
    return md.rstrip() + "\n\n" + section + "\n"


def command_line() -> str:
    args = [a for a in sys.argv[1:]]
    for i, a in enumerate(args):  # no machine path in the docs
        if i and args[i - 1] == "--traces-dir":
            args[i] = "DIR"
        elif a.startswith("--traces-dir="):
            args[i] = "--traces-dir=DIR"
    return " ".join([".venv/bin/python bench/replay_scale.py", *args])


def run_tiers(args, paths, limits) -> str:
    sizes = [int(x) for x in args.sizes.split(",")]
    tiers = [int(x) for x in args.tiers.split(",")]
    tasks = [(paths[n], limits[n], nb, t) for n in TRACES for nb in sizes for t in tiers]
    t0 = time.time()
    with ProcessPoolExecutor(args.jobs) as ex:
        results = {(p, nb, t): d for p, nb, t, d in ex.map(_tier_job, tasks)}
    elapsed = time.time() - t0
    lines = [
        "## A CPU tier below the pool: hit rate vs pool size",
        "",
        "`prefixkv replay TRACE --num-blocks N --cpu-tier-blocks M` puts an LRU tier of M blocks under",
        "the pool (`prefixkv/replay/tier.py`): every cached block the pool evicts is copied into it, and a",
        "lookup continues the request's chain in it where the pool's hits end (the engine's lookup rule",
        "still applies). Cells: tokens not recomputed / prompt tokens (pool + tier); in brackets the",
        "pool's own share. Policy `lru`, block size 512, the same traces and request counts as above.",
        "",
        f"Command: `{command_line()}` ({elapsed:.0f} s wall, {args.jobs} processes, on a shared 2-core machine)",
        "",
        "```bash",
        "prefixkv replay examples/traces/conversation_sample.jsonl --num-blocks 1000 --cpu-tier-blocks 0,8000",
        "```",
        "",
    ]
    for name in TRACES:
        trace = _trace(paths[name], limits[name])
        ceiling = infinite_cache_hit_rate(trace, 512)
        scope = f"first {limits[name]} requests" if limits[name] else f"all {len(trace)} requests"
        lines += [f"### {name} ({scope}; infinite-cache ceiling {ceiling:.1%})", ""]
        lines.append("| pool blocks | " + " | ".join("no tier" if t == 0 else f"+ CPU tier {t}" for t in tiers) + " |")
        lines.append("| ---: | " + " | ".join("---:" for _ in tiers) + " |")
        for nb in sizes:
            cells = []
            for t in tiers:
                d = results[paths[name], nb, t]
                cells.append(f"{d['total_hit_rate']:.1%}" + (f" ({d['hit_rate']:.1%})" if t else ""))
            lines.append(f"| {nb} | " + " | ".join(cells) + " |")
        lines += ["", f"![{name} with a CPU tier](replay_tiers_{name}.png)", ""]
        if not args.no_docs:
            plot_tiers(Path(args.out) / f"replay_tiers_{name}.png", name, sizes, tiers, paths[name], results, ceiling)
    return "\n".join(lines)


def plot_tiers(path, name, sizes, tiers, trace_path, results, ceiling) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    for t in tiers:
        label = "pool only" if t == 0 else f"pool + CPU tier of {t} blocks"
        ax.plot(sizes, [results[trace_path, nb, t]["total_hit_rate"] for nb in sizes], marker="o", label=label)
    ax.axhline(ceiling, color="grey", lw=0.8, ls=":", label="infinite cache")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("pool size (blocks of 512 tokens)")
    ax.set_ylabel("token hit rate (pool + tier)")
    ax.set_title(f"{name} trace: a CPU tier below the pool (lru)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["tiers", "replicas", "all"], default="all")
    ap.add_argument(
        "--traces-dir",
        default=os.environ.get("PREFIXKV_TRACES", "traces"),
        help="folder with the Mooncake conversation_trace.jsonl and synthetic_trace.jsonl "
        "(default: $PREFIXKV_TRACES, else ./traces; see examples/traces/README.md)",
    )
    ap.add_argument("--conversation-limit", type=int, default=6000, help="first N requests (0 = all)")
    ap.add_argument("--synthetic-limit", type=int, default=0, help="0 = all")
    ap.add_argument("--sizes", default="1000,2000,4000,8000,16000,32000", help="pool sizes (tiers part)")
    ap.add_argument("--tiers", default="0,8000,32000", help="CPU tier sizes in blocks, 0 = none (tiers part)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default=str(HERE.parent / "docs"))
    ap.add_argument("--no-docs", action="store_true", help="print the tables only")
    args, rest = ap.parse_known_args()
    paths = {name: os.path.join(args.traces_dir, f"{name}_trace.jsonl") for name in TRACES}
    missing = [p for p in paths.values() if not os.path.exists(p)]
    if missing:
        print(f"missing traces: {missing} (see examples/traces/README.md)", file=sys.stderr)
        return 2
    limits = {"conversation": args.conversation_limit or None, "synthetic": args.synthetic_limit or None}
    sections = {}
    if args.part in ("tiers", "all"):
        sections["tiers"] = run_tiers(args, paths, limits)
    if args.part in ("replicas", "all"):
        from bench.replay_replicas import run_replicas

        sections["replicas"] = run_replicas(args, rest, paths, limits, command_line())
    for name, md in sections.items():
        print(md)
        if not args.no_docs:
            page = Path(args.out) / "replay.md"
            page.write_text(splice(page.read_text(), name, md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
