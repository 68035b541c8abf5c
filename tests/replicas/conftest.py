"""Two engine replicas of a tiny random Llama on Ray Serve, behind the prefix-aware router: Ray and
Serve start once for the package (`ray_serve`, ~10 s each way on 2 cores), and each test module
deploys its own application on them (module-scoped fixture) and deletes it at its end. A deploy
costs ~20-25 CPU-seconds, nearly all of it each engine replica's worker process importing torch,
Ray Serve and prefixkv (the ingress imports no torch); the requests the tests send cost little next
to it. While an application is up, the router's polls and Serve's controller cost CPU all along.

`make test` hands each xdist worker a file at a time, and a worker that leaves this package tears
`ray_serve` down: the modules that deploy one application each share one estimate, slow(seconds=30),
so that they sit together in the queue and tend to run back to back on one worker, on one Ray start."""

from __future__ import annotations

import os
import re
import socket
import time
from typing import Any

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from prefixkv.replicas.app import APP_NAME, build_application, parse_builder_args  # noqa: E402

from ..tiers.conftest import make_tiny  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCK = 4
# The tiny tokenizer has no chat template: a plain one, so the chat route works
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, base: str, model: str, args: Any) -> None:
        self.base = base
        self.model = model
        self.args = args
        self.client = httpx.Client(base_url=base, timeout=60)

    def metrics(self) -> dict[tuple[str, str], float]:
        """(sample name, replica label) -> value, other labels summed over."""
        out: dict[tuple[str, str], float] = {}
        for line in self.client.get("/metrics").text.splitlines():
            m = re.match(r'^([^{\s#]+)\{replica="([^"]*)"[^}]*\}\s+(\S+)$', line)
            if m:
                key = (m.group(1), m.group(2))
                out[key] = out.get(key, 0.0) + float(m.group(3))
        return out

    def wait_idle(self, timeout: float = 30.0) -> dict[tuple[str, str], float]:
        """Every replica up, idle, with no KV block held."""
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            replicas = {r for (_, r) in m if r != "router"}
            busy = [
                k
                for k, v in m.items()
                if k[0] in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")
                and v != 0
            ]
            if len(replicas) == self.args.replicas and not busy:
                return m
            if time.time() > deadline:
                raise AssertionError(f"replicas not idle after {timeout}s: {busy} {sorted(replicas)}")
            time.sleep(0.2)

    def replica_info(self) -> list[dict[str, Any]]:
        return [
            serve.get_deployment_handle(f"engine-{i}", APP_NAME).info.remote().result(timeout_s=30)
            for i in range(self.args.replicas)
        ]


@pytest.fixture(scope="package")
def ray_serve():
    """The HTTP port of a local Ray + Serve, shared by the modules of tests/replicas."""
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    # the replicas' POST /reset_prefix_cache: Ray's workers inherit the environment ray.init starts
    # them from; this process's own apps (other test packages) must not
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"
    # Serve's controller reconciles every 0.1 s by default, ~5% of a core the whole time an
    # application is up; every 0.5 s a deploy or a restart is seen a few tenths of a second later
    os.environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] = "0.5"
    try:
        # no Ray metrics collection: nothing here reads Ray's own metrics (the /metrics checked are
        # prefixkv's), and its agent's collecting and exporting costs CPU the whole time
        ray.init(
            num_cpus=4,
            include_dashboard=False,
            logging_level="warning",
            log_to_driver=False,
            _system_config={"enable_metrics_collection": False},
        )
    finally:
        del os.environ["VLLM_SERVER_DEV_MODE"], os.environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"]
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield port
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="package")
def replica_model(tmp_path_factory) -> str:
    """One tiny Llama folder for every module's application (the same seeded weights each time)."""
    return make_tiny(tmp_path_factory.mktemp("tiny-llama"))


def start_cluster(model: str, port: int, **flags: Any) -> Cluster:
    builder = {
        "model": model,
        "replicas": 2,
        "block_size": BLOCK,
        "num_gpu_blocks_override": 64,
        "max_model_len": 256,
        "dtype": "float32",
        "replica_torch_threads": 1,
        "replica_num_cpus": 1,
        "chat_template": CHAT_TEMPLATE,
        # the router polls each replica at the default --router-poll-interval (0.5 s): two actor
        # calls per replica a poll, ~6% of a core in each process at 0.2 s
        **flags,
    }
    args = parse_builder_args(builder)
    serve.run(build_application(args), name=APP_NAME, route_prefix="/")
    cluster = Cluster(f"http://127.0.0.1:{port}", model, args)
    deadline = time.time() + 60
    while cluster.client.get("/health").status_code != 200:  # the router's first poll
        assert time.time() < deadline, "the ingress never became healthy"
        time.sleep(0.2)
    return cluster


def stop_cluster(cluster: Cluster, wait: bool = False) -> None:
    """Delete the application: its engines and ingress; Ray and Serve stay for the next module.
    Not waited for unless `wait`: each replica drains for 2 s or more, idle, and the next module's
    serve.run replaces whatever is left (package teardown's serve.shutdown stops the rest)."""
    cluster.client.close()
    serve.delete(APP_NAME, _blocking=wait)
