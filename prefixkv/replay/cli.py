"""`prefixkv replay TRACE`: replay a request trace through the real KVCacheManager.

Wiring: the `prefixkv` command calls `add_arguments(subparser)` and `run(args)`.
"""

from __future__ import annotations

import argparse
import json
import sys

from prefixkv.cache import POLICIES
from prefixkv.router import MODES, ROUTERS
from prefixkv.router.index import DEFAULT_TIER_DISCOUNT

from .cluster import MEASURED_PREFILL_TOKENS_PER_S, TIER_LOAD_COST, replay_cluster
from .optimum import BlockIndex, infinite_cache_hit_rate, replay_optimum
from .simulator import TimeModel, replay
from .trace import load_trace


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of block counts: {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError("cache sizes must be positive block counts")
    return sizes


def _tier_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of block counts: {text!r}") from None
    if not sizes or min(sizes) < 0:
        raise argparse.ArgumentTypeError("CPU tier sizes are block counts >= 0 (0: no tier)")
    return sizes


def _routers(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if names == ["all"]:
        return list(ROUTERS)
    for name in names:
        if name not in ROUTERS:
            raise argparse.ArgumentTypeError(f"unknown router {name!r}; choose from {', '.join(ROUTERS)} or all")
    return names


def _policies(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if names == ["all"]:
        return list(POLICIES)
    for name in names:
        if name not in POLICIES:
            raise argparse.ArgumentTypeError(
                f"unknown eviction policy {name!r}; choose from {', '.join(POLICIES)} or all"
            )
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "trace",
        help="JSONL trace: Mooncake records (hash_ids) or simple records "
        "(prompt / prompt_token_ids, optional timestamp ms and output_length)",
    )
    parser.add_argument("--format", default="auto", choices=["auto", "mooncake", "jsonl"])
    parser.add_argument(
        "--num-blocks", type=_sizes, default=[4096], metavar="N[,N...]", help="cache size(s) in blocks (default 4096)"
    )
    parser.add_argument(
        "--block-size", type=int, default=512, help="tokens per block (default 512, the Mooncake trace's granularity)"
    )
    parser.add_argument(
        "--policy",
        type=_policies,
        default=["lru"],
        metavar="NAME[,NAME...]",
        help=f"eviction policies: {', '.join(POLICIES)}, or all (default lru)",
    )
    parser.add_argument(
        "--optimum",
        action="store_true",
        help="also run Belady's offline optimum and report each policy's fraction of it",
    )
    parser.add_argument(
        "--reuse-oracle",
        action="store_true",
        help="also run the offline reuse oracle (knows whether a block returns, "
        "not when): what a perfect reuse predictor would reach",
    )
    parser.add_argument(
        "--cpu-tier-blocks",
        type=_tier_sizes,
        default=[0],
        metavar="N[,N...]",
        help="a CPU tier of N blocks below the pool, LRU, filled by the pool's evictions and read where the pool's "
        "hits end; 0 = none; several sizes are swept (default 0; see docs/replay.md)",
    )
    g = parser.add_argument_group(
        "replicas behind a router (docs/replay.md; the cache size is per replica, the first --policy is used)"
    )
    g.add_argument(
        "--replicas",
        type=_sizes,
        default=None,
        metavar="N[,N...]",
        help="simulate N replicas behind --router instead of one pool",
    )
    g.add_argument(
        "--router",
        type=_routers,
        default=["round-robin", "prefix", "prefix-load"],
        metavar="NAME[,NAME...]",
        help=f"routing policies: {', '.join(ROUTERS)}, or all (default all)",
    )
    g.add_argument(
        "--router-index",
        default="events",
        choices=list(MODES),
        help="events: the router learns each replica's cache from its KV events, plus what it sent that the "
        "replica has not admitted yet; events-only: the events alone; approx: what it sent, LRU within the "
        "replica's size (default events)",
    )
    g.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=MEASURED_PREFILL_TOKENS_PER_S,
        help="prefill speed of one replica, for the TTFT estimate (default 842: prefixkv's measured prefill of "
        "1,024 tokens, SmolLM2-135M float32 on 2 CPU threads, docs/benchmarks.md)",
    )
    g.add_argument(
        "--shared-tier-blocks",
        type=int,
        default=0,
        metavar="M",
        help="a tier of M blocks below every replica that all of them read (a shared Redis): pool evictions "
        "enter it, lookups continue there; 0 = none (default)",
    )
    g.add_argument(
        "--tier-discount",
        type=float,
        default=DEFAULT_TIER_DISCOUNT,
        help="the router counts a block only a tier holds as this much of a pool block (default 0.5)",
    )
    g.add_argument(
        "--tier-load-cost",
        type=float,
        default=TIER_LOAD_COST,
        help="a token loaded from the shared tier costs this much of a computed token's time (default 0.05)",
    )
    g.add_argument("--max-queue", type=int, default=4, help="prefix-load: a replica with this many queued is saturated")
    g.add_argument("--max-kv-usage", type=float, default=0.95, help="prefix-load: ... or this KV usage")
    g.add_argument(
        "--balance-abs", type=int, default=4, help="prefix-load: skip replicas queued > balance-rel x least + this"
    )
    g.add_argument("--balance-rel", type=float, default=2.0, help="prefix-load: see --balance-abs")
    g.add_argument(
        "--min-match-blocks", type=int, default=1, help="prefix-load: shorter cached prefixes go to the least loaded"
    )
    parser.add_argument(
        "--pin-top",
        type=int,
        default=0,
        metavar="N",
        help="pin the N prefixes most requests share (system prompts: whole blocks every request starting with "
        "the same block repeats), each once its first request is cached (default 0; single pool only)",
    )
    parser.add_argument(
        "--max-pinned-fraction", type=float, default=0.5, help="share of the pool pins may hold (default 0.5)"
    )
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--prefill-ms-per-token", type=float, default=TimeModel.prefill_ms_per_token)
    parser.add_argument("--decode-ms-per-token", type=float, default=TimeModel.decode_ms_per_token)
    parser.add_argument(
        "--no-reserve-output", action="store_true", help="do not hold blocks for the output tokens (prompt only)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per result")


def run(args: argparse.Namespace) -> int:
    if args.block_size < 1:
        print("error: --block-size must be at least 1", file=sys.stderr)
        return 2
    try:
        trace = load_trace(args.trace, args.limit, args.format)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tm = TimeModel(args.prefill_ms_per_token, args.decode_ms_per_token, not args.no_reserve_output)
    if args.pin_top < 0 or not 0.0 <= args.max_pinned_fraction <= 1.0:
        print("error: --pin-top must be >= 0 and --max-pinned-fraction in [0, 1]", file=sys.stderr)
        return 2
    if args.pin_top and args.replicas is not None:
        print("error: --pin-top replays one pool; it does not combine with --replicas", file=sys.stderr)
        return 2
    if args.replicas is not None:
        return _run_cluster(args, trace, tm)
    index = BlockIndex(trace, args.block_size) if args.optimum or args.reuse_oracle else None
    print(
        f"{args.trace}: {len(trace)} requests, block size {args.block_size}, "
        f"{sum(r.input_length for r in trace)} prompt tokens"
    )
    if index is not None:
        print(f"infinite-cache ceiling: {infinite_cache_hit_rate(trace, args.block_size, index):.2%}")
    tiers = args.cpu_tier_blocks
    with_tier = tiers != [0]
    header = (
        f"{'blocks':>8} {'policy':<16} {'hit rate':>9} {'of opt':>7} {'evictions':>10} {'peak use':>9} "
        f"{'waited':>7} {'skipped':>7}"
    ) + (f" {'cpu tier':>9} {'tier hit':>9} {'total hit':>9}" if with_tier else "")
    if args.pin_top:
        header += f" {'pinned':>7} {'blocks':>7} {'refused':>7}"
    if not args.json:
        print(header)
    for num_blocks in args.num_blocks:
        opt = replay_optimum(trace, num_blocks, args.block_size, tm, index) if args.optimum else None
        rows = [
            replay(
                trace,
                num_blocks,
                args.block_size,
                name,
                tm,
                cpu_tier_blocks=tier,
                pin_top=args.pin_top,
                max_pinned_fraction=args.max_pinned_fraction,
            )
            for name in args.policy
            for tier in tiers
        ]
        if args.reuse_oracle:
            rows.append(replay_optimum(trace, num_blocks, args.block_size, tm, index, reuse_oracle=True))
        if opt is not None:
            rows.append(opt)
        for r in rows:
            frac = r.hit_rate / opt.hit_rate if opt is not None and opt.hit_rate else None
            if args.json:
                print(json.dumps({**r.as_dict(), "fraction_of_optimum": frac}))
            else:
                print(
                    f"{num_blocks:>8} {r.policy:<16} {r.hit_rate:>9.2%} "
                    f"{'' if frac is None else f'{frac:.1%}':>7} {r.evictions:>10} "
                    f"{r.peak_usage:>9.1%} {r.waited:>7} {r.skipped:>7}"
                    + (f" {r.cpu_tier_blocks:>9} {r.tier_hit_rate:>9.2%} {r.total_hit_rate:>9.2%}" if with_tier else "")
                    + (
                        f" {r.pinned_prefixes:>7} {r.pinned_blocks:>7} {r.pins_refused:>7}"
                        if args.pin_top and hasattr(r, "pinned_prefixes")
                        else ""
                    )
                )
    return 0


def _run_cluster(args: argparse.Namespace, trace: list, tm: TimeModel) -> int:
    if args.optimum or args.reuse_oracle or args.cpu_tier_blocks != [0]:
        print("error: --replicas does not combine with --optimum, --reuse-oracle or --cpu-tier-blocks", file=sys.stderr)
        return 2
    knobs = dict(
        max_queue=args.max_queue,
        max_kv_usage=args.max_kv_usage,
        balance_abs=args.balance_abs,
        balance_rel=args.balance_rel,
        min_match_blocks=args.min_match_blocks,
    )
    print(
        f"{args.trace}: {len(trace)} requests, block size {args.block_size}, {args.num_blocks[0]} blocks per replica, "
        f"eviction {args.policy[0]}, prefill {args.prefill_tokens_per_s:g} tokens/s per replica"
    )
    if not args.json:
        print(
            f"{'replicas':>8} {'router':<12} {'index':<6} {'hit rate':>9} {'imb req':>8} {'imb work':>8} "
            f"{'TTFT p50':>9} {'TTFT p90':>9} {'mean':>9} {'skipped':>7}"
            + (f" {'tier hit':>9} {'total hit':>9}" if args.shared_tier_blocks else "")
        )
    for n in args.replicas:
        for router in args.router:
            try:
                r = replay_cluster(
                    trace,
                    n,
                    router,
                    args.num_blocks[0],
                    args.block_size,
                    args.policy[0],
                    tm,
                    args.prefill_tokens_per_s,
                    args.router_index,
                    args.shared_tier_blocks,
                    args.tier_discount,
                    args.tier_load_cost,
                    **(knobs if router == "prefix-load" else {}),
                )
            except ValueError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            if args.json:
                print(json.dumps(r.as_dict()))
            else:
                print(
                    f"{n:>8} {router:<12} {r.index_mode:<6} {r.hit_rate:>9.2%} {r.imbalance_requests:>8.2f} "
                    f"{r.imbalance_prefill:>8.2f} {r.ttft_percentile(0.5) / 1e3:>8.2f}s "
                    f"{r.ttft_percentile(0.9) / 1e3:>8.2f}s {r.ttft_mean_ms / 1e3:>8.2f}s {r.skipped:>7}"
                    + (
                        f" {r.tier_hit_tokens / max(r.prompt_tokens, 1):>9.2%} {r.total_hit_rate:>9.2%}"
                        if args.shared_tier_blocks
                        else ""
                    )
                )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefixkv replay", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
