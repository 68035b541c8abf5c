"""`prefixkv serve --replicas N` flags: how many engine replicas, which router, its knobs; and the
whole `prefixkv serve` flag set, which each replica serves with (the CLI and the Serve builder).

Plain argparse, no Ray import: the flags exist (and --help lists them) whether or not ray[serve]
is installed; Ray is imported only when --replicas is 2 or more.
"""

from __future__ import annotations

import argparse

from ..engine_args import EngineArgs
from ..router import MODES, ROUTERS
from ..server.launch import add_server_args

# dest -> flag of every flag that only the replicated server reads (all but --replicas), and the
# prefix-load knobs among them: given where nothing reads them, they are refused by name
ROUTER_FLAGS = {
    "router": "--router",
    "router_index": "--router-index",
    "max_queue": "--max-queue",
    "max_kv_usage": "--max-kv-usage",
    "balance_abs": "--balance-abs",
    "balance_rel": "--balance-rel",
    "min_match_blocks": "--min-match-blocks",
    "router_retries": "--router-retries",
    "router_poll_interval": "--router-poll-interval",
    "replica_num_cpus": "--replica-num-cpus",
    "replica_torch_threads": "--replica-torch-threads",
    "ray_address": "--ray-address",
}
PREFIX_LOAD_KNOBS = ("max_queue", "max_kv_usage", "balance_abs", "balance_rel", "min_match_blocks")
_DEFAULTS: dict[str, object] = {}  # filled by add_replica_args from the parser


def _given(args: argparse.Namespace, dests: tuple[str, ...] | list[str]) -> list[str]:
    """The flags among `dests` set to something other than their default."""
    return [ROUTER_FLAGS[d] for d in dests if d in _DEFAULTS and getattr(args, d, _DEFAULTS[d]) != _DEFAULTS[d]]


def add_replica_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "replicas (--replicas N >= 2: N engines on Ray Serve behind one prefix-aware router; docs/replicas.md)"
    )
    g.add_argument(
        "--replicas",
        type=int,
        default=1,
        metavar="N",
        help="engine replicas; 2 or more runs them as Ray Serve deployments behind one endpoint "
        "(needs the `replicas` extra: pip install 'prefixkv[replicas]') (default: 1, no Ray)",
    )
    g.add_argument(
        "--router",
        choices=ROUTERS,
        default="prefix-load",
        help="which replica gets a request: round-robin; prefix (the replica caching the longest prefix of "
        "its block hashes); prefix-load (prefix, gated by load) (default: prefix-load)",
    )
    g.add_argument(
        "--router-index",
        choices=MODES,
        default="events",
        help="how the router knows the replicas' caches: events (their KV events, plus requests in flight), "
        "events-only, approx (what it sent, LRU per replica; no events) (default: events)",
    )
    g.add_argument(
        "--max-queue",
        type=int,
        default=4,
        help="prefix-load: a replica with this many requests not yet past prefill is saturated (default: 4)",
    )
    g.add_argument(
        "--max-kv-usage",
        type=float,
        default=0.95,
        help="prefix-load: ... or with this fraction of its KV blocks held (default: 0.95)",
    )
    g.add_argument(
        "--balance-abs",
        type=int,
        default=4,
        help="prefix-load: a replica whose queue exceeds balance-rel x the least queue + balance-abs is "
        "skipped (default: 4)",
    )
    g.add_argument("--balance-rel", type=float, default=2.0, help="prefix-load: see --balance-abs (default: 2.0)")
    g.add_argument(
        "--min-match-blocks",
        type=int,
        default=1,
        help="prefix-load: a cached prefix shorter than this many blocks is ignored (default: 1)",
    )
    g.add_argument(
        "--router-retries",
        type=int,
        default=2,
        help="other replicas to try when the chosen one dies before the response started (default: 2)",
    )
    g.add_argument(
        "--router-poll-interval",
        type=float,
        default=0.5,
        help="seconds between the router's load and health polls of each replica (default: 0.5)",
    )
    g.add_argument(
        "--replica-num-cpus",
        type=float,
        default=1.0,
        help="Ray CPUs reserved per engine replica (default: 1)",
    )
    g.add_argument(
        "--replica-torch-threads",
        type=int,
        default=None,
        help="torch threads per engine replica (default: this machine's cores / N, at least 1)",
    )
    g.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (e.g. auto) instead of starting a local one",
    )
    _DEFAULTS.update({dest: parser.get_default(dest) for dest in ROUTER_FLAGS})


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Every flag of `prefixkv serve`: the engine's, the server's, and the replicas' own."""
    EngineArgs.add_cli_args(parser)  # the engine's flags: one source, prefixkv/engine_args.py
    add_server_args(parser)
    add_replica_args(parser)


def serve_parser() -> argparse.ArgumentParser:
    """A parser of `prefixkv serve`'s flags alone (what follows `prefixkv serve` on a command line)."""
    parser = argparse.ArgumentParser(prog="prefixkv serve")
    add_serve_args(parser)
    return parser


def check_single_engine_args(args: argparse.Namespace) -> None:
    """`serve` without --replicas: a router or replica flag would be accepted without effect."""
    given = _given(args, list(ROUTER_FLAGS))
    if given:
        raise ValueError(f"{', '.join(given)}: used only with --replicas N (N >= 2); one engine has no router")


def router_knobs(args: argparse.Namespace) -> dict[str, float]:
    """The knobs the chosen router takes (prefix-load only), checked by the router itself."""
    if args.router != "prefix-load":
        return {}
    return {
        "max_queue": args.max_queue,
        "max_kv_usage": args.max_kv_usage,
        "balance_abs": args.balance_abs,
        "balance_rel": args.balance_rel,
        "min_match_blocks": args.min_match_blocks,
    }


def check_replica_args(args: argparse.Namespace) -> None:
    """Refuse what the replicated server cannot honour, before Ray starts."""
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if args.router_retries < 0 or args.router_poll_interval <= 0 or args.replica_num_cpus < 0:
        raise ValueError("--router-retries >= 0, --router-poll-interval > 0 and --replica-num-cpus >= 0")
    if args.replica_torch_threads is not None and args.replica_torch_threads < 1:
        raise ValueError(f"--replica-torch-threads must be >= 1, got {args.replica_torch_threads}")
    if getattr(args, "kv_events_config", None):
        raise ValueError(
            "--kv-events-config with --replicas: each replica publishes its KV events on an endpoint of "
            "its own, which the router subscribes to; the flag cannot be honoured"
        )
    # the endpoint is Ray Serve's HTTP proxy, not the uvicorn app these flags configure
    for dest, flag in (
        ("ssl_certfile", "--ssl-certfile"),
        ("root_path", "--root-path"),
        ("allowed_origins", "--allowed-origins"),
    ):
        if getattr(args, dest, None):
            raise ValueError(f"{flag} with --replicas: the replicated endpoint (Ray Serve's proxy) cannot honour it")
    unused = _given(args, PREFIX_LOAD_KNOBS) if args.router != "prefix-load" else []
    if unused:
        raise ValueError(f"{', '.join(unused)}: knobs of --router prefix-load only, not of {args.router}")
    from ..router import make_router

    if args.router != "round-robin":  # the knobs' own checks, now rather than in every replica
        from ..router import PrefixIndex

        make_router(args.router, PrefixIndex("events"), **router_knobs(args))
    algo = getattr(args, "prefix_caching_hash_algo", "sha256_cbor")
    if args.router != "round-robin" and args.router_index != "approx" and str(algo).startswith("xxhash"):
        raise ValueError(
            f"--prefix-caching-hash-algo {algo} is seeded per process, so the router cannot compute the "
            "replicas' block hashes: use sha256_cbor / sha256, or --router-index approx"
        )
