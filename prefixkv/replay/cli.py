"""`prefixkv replay TRACE`: replay a request trace through the real KVCacheManager.

Wiring: the `prefixkv` command calls `add_arguments(subparser)` and `run(args)`.
"""

from __future__ import annotations

import argparse
import json
import sys

from prefixkv.cache import POLICIES

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
    if not args.json:
        print(header)
    for num_blocks in args.num_blocks:
        opt = replay_optimum(trace, num_blocks, args.block_size, tm, index) if args.optimum else None
        rows = [
            replay(trace, num_blocks, args.block_size, name, tm, cpu_tier_blocks=tier)
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
                    + (
                        f" {r.cpu_tier_blocks:>9} {r.tier_hit_rate:>9.2%} {r.total_hit_rate:>9.2%}"
                        if with_tier
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
