"""The replicas part of bench/replay_scale.py: N replicas x routers on the Mooncake traces
(prefixkv replay --replicas N --router R), as a markdown section for docs/replay.md."""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor

from prefixkv.replay import load_mooncake
from prefixkv.replay.cluster import MEASURED_PREFILL_TOKENS_PER_S, replay_cluster
from prefixkv.router import ROUTERS

TRACES = ("conversation", "synthetic")
_STATE: dict = {}


def _job(task):
    path, limit, n, router, blocks, mode = task
    if _STATE.get("key") != (path, limit):
        _STATE.update(key=(path, limit), trace=load_mooncake(path, limit))
    r = replay_cluster(_STATE["trace"], n, router, blocks, index_mode=mode)
    return path, n, router, mode, r.as_dict()


def run_replicas(args, rest: list[str], paths: dict, limits: dict, command: str) -> str:
    ap = argparse.ArgumentParser(prog="bench/replay_scale.py --part replicas")
    ap.add_argument("--replicas", default="8,16,32,64")
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--blocks-per-replica", type=int, default=1000)
    ap.add_argument(
        "--all-indexes", action="store_true", help="also prefix-load with the events-only and approximate indexes"
    )
    own = ap.parse_args(rest)
    ns = [int(x) for x in own.replicas.split(",")]
    routers = own.routers.split(",")
    variants = [(r, "events") for r in routers]
    if own.all_indexes:
        variants += [("prefix-load", "events-only"), ("prefix-load", "approx")]
    tasks = [(paths[t], limits[t], n, r, own.blocks_per_replica, m) for t in TRACES for n in ns for r, m in variants]
    t0 = time.time()
    with ProcessPoolExecutor(args.jobs) as ex:
        results = {(p, n, r, m): d for p, n, r, m, d in ex.map(_job, tasks)}
    elapsed = time.time() - t0
    lines = [
        "## Replicas behind a router: hit rate, load imbalance, TTFT",
        "",
        "`prefixkv replay TRACE --replicas N --router R --num-blocks B` simulates N replicas of B blocks",
        "each (`prefixkv/replay/cluster.py`), every one a real KVCacheManager with its own FCFS queue,",
        "behind a `prefixkv/router` policy; the router's index is fed by the replicas' KV events plus",
        "pending entries for what it sent that a replica has not admitted yet (`--router-index events`,",
        "the default; `events-only` and `approx` - what it sent, LRU - for comparison). Policies:",
        "`round-robin`; `prefix` (longest cached",
        "prefix of the request's chained block hashes; ties to the least loaded); `prefix-load`",
        "(prefix among the replicas that are not saturated - >= 4 queued requests or >= 95% KV usage -",
        "unless all are, and not queued more than 2 x the least queued + 4; knobs `--max-queue",
        "--max-kv-usage --balance-abs --balance-rel --min-match-blocks`, defaults shown; the policy is",
        "documented in `prefixkv/router/policy.py`). TTFT: each replica prefills one request at a time at",
        f"{MEASURED_PREFILL_TOKENS_PER_S:g} tokens/s over the tokens its cache lacks - prefixkv's measured",
        "prefill speed on this project's 2-core CPU (`bench/model_speed.py`, 1,024 tokens, SmolLM2-135M",
        "float32, docs/benchmarks.md) - so absolute TTFTs are those of that model on that CPU and scale",
        "inversely with the speed; the comparison between routers is the point. Imbalance: max / mean",
        "over replicas of requests received (req) and of prefill tokens computed (work).",
        "",
        f"Command: `{command}` ({elapsed:.0f} s wall, {args.jobs} processes, on a shared 2-core machine",
        "under heavy load; the figures are simulated, so load changes only the wall time)",
        "",
        "```bash",
        "prefixkv replay examples/traces/conversation_sample.jsonl --replicas 8,16 --router all --num-blocks 1000",
        "```",
        "",
    ]
    for name in TRACES:
        scope = f"first {limits[name]} requests" if limits[name] else "all requests"
        lines += [
            f"### {name} ({scope}; {own.blocks_per_replica} blocks of 512 tokens per replica, lru)",
            "",
            "| replicas | router | hit rate | imbalance req / work | TTFT p50 | TTFT p90 | TTFT mean |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for n in ns:
            for r, m in variants:
                d = results[paths[name], n, r, m]
                label = r if m == "events" else f"{r} ({m} index)"
                lines.append(
                    f"| {n} | {label} | {d['hit_rate']:.1%} | {d['imbalance_requests']:.2f} / "
                    f"{d['imbalance_prefill']:.2f} | {d['ttft_p50_ms'] / 1e3:.1f} s | {d['ttft_p90_ms'] / 1e3:.1f} s | "
                    f"{d['ttft_mean_ms'] / 1e3:.1f} s |"
                )
        lines.append("")
    return "\n".join(lines)
