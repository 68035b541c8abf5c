"""The Ray Serve application: N engine deployments and the ingress, and the way to run it.

build_application(args)  the Application from parsed `prefixkv serve` flags
build_app(cli_args)      the builder `serve run` calls with key=value pairs, for users who run Ray:
                           serve run prefixkv.replicas.app:build_app replicas=2 router=prefix-load
serve_replicas(args)     `prefixkv serve MODEL --replicas N`: start (or join) Ray, run, wait for a signal
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import threading
from typing import Any

from ray import serve
from ray.serve import Application

from .args import check_replica_args, serve_parser
from .engine_replica import EngineReplica
from .ingress import Ingress

logger = logging.getLogger("prefixkv.replicas")
APP_NAME = "prefixkv"
# The engine queues and batches itself: Serve must not cap or queue requests in front of it
MAX_ONGOING_REQUESTS = 100_000
HEALTH_CHECK_PERIOD_S = 2.0


def build_application(args: argparse.Namespace) -> Application:
    engines = [
        serve.deployment(
            name=f"engine-{i}",
            num_replicas=1,
            max_ongoing_requests=MAX_ONGOING_REQUESTS,
            health_check_period_s=HEALTH_CHECK_PERIOD_S,
            health_check_timeout_s=30.0,
            graceful_shutdown_timeout_s=max(2.0, float(getattr(args, "shutdown_timeout", 2.0) or 2.0)),
            ray_actor_options={"num_cpus": args.replica_num_cpus},
            logging_config={"enable_access_log": False},  # the router's polls: every few hundred ms
        )(EngineReplica).bind(args, i)
        for i in range(args.replicas)
    ]
    ingress = serve.deployment(
        name="ingress",
        num_replicas=1,
        max_ongoing_requests=MAX_ONGOING_REQUESTS,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        ray_actor_options={"num_cpus": 0},
    )(Ingress)
    app: Application = ingress.bind(args, engines)
    return app


def parse_builder_args(cli_args: dict[str, Any]) -> argparse.Namespace:
    """`serve run ... key=value` pairs as `prefixkv serve` flags: model=PATH is the positional,
    max_model_len=1024 is --max-model-len 1024, a flag without value takes true (false: left out)."""
    argv: list[str] = []
    rest = dict(cli_args)
    model = rest.pop("model", None)
    if model:
        argv.append(str(model))
    for key, value in rest.items():
        flag = "--" + str(key).replace("_", "-")
        text = str(value)
        if value is True or text.lower() == "true":
            argv.append(flag)
        elif value is False or text.lower() == "false":
            continue
        else:
            argv += [flag, text]
    args = serve_parser().parse_args(argv)
    check_replica_args(args)
    return args


def build_app(cli_args: dict[str, Any]) -> Application:
    """Ray Serve's application builder: `serve run prefixkv.replicas.app:build_app replicas=2 ...`."""
    return build_application(parse_builder_args(cli_args))


def serve_replicas(args: argparse.Namespace) -> int:
    """`prefixkv serve --replicas N`: the replicated server in the foreground until SIGINT / SIGTERM."""
    import ray

    from ..server.launch import PortInUse, bind_socket

    # its flags were checked by the CLI, before this module imported Ray
    try:  # fail at once on a taken port, not after Ray and N models have started
        bind_socket(args.host, args.port).close()
    except PortInUse as e:
        print(f"prefixkv serve: {e}", file=sys.stderr)
        return 1
    if args.ray_address:
        ray.init(address=args.ray_address)
    else:
        cpus = max(os.cpu_count() or 1, math.ceil(args.replicas * args.replica_num_cpus))
        ray.init(num_cpus=cpus, include_dashboard=False)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_application(args), name=APP_NAME, route_prefix="/")
        logger.info(
            "serving %d engine replicas on http://%s:%d (router %s, index %s)",
            args.replicas,
            args.host,
            args.port,
            args.router,
            args.router_index,
        )
        stop.wait()
        logger.info("signal: shutting the replicas down")
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()
    return 0
