"""One engine replica: an LLMEngine and the single-engine OpenAI app, inside a Ray Serve replica.

Each replica is its own Serve deployment with num_replicas=1 (`engine-0`, `engine-1`, ...), so the
ingress holds one handle per engine and decides itself which one gets a request; Serve starts,
health-checks and restarts them. The replica
  * serves HTTP requests handed over by the ingress through the very app `prefixkv serve` builds
    (asgi_bridge.py): same routes, errors, SSE;
  * publishes its KV events over ZeroMQ (the existing publisher) on ports of its own, with a replay
    socket, and tells the ingress where (`info()`);
  * reports its load (`load()`: waiting / running requests, KV usage) and its Prometheus text;
  * names a LoRA adapter's block-key identity (`lora_block_key()`), for the router's hashes.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import ray
import torch

from ..cache.identity import lora_extra_key
from ..engine.llm_engine import LLMEngine
from ..engine_args import EngineArgs
from ..kv_events import ZmqEventPublisher
from ..server.app import DEFAULT_MODEL_NAME
from ..server.launch import app_from_args
from .asgi_bridge import call_asgi
from .event_feed import event_bind_host, tcp_endpoint
from .response_home import response_id_prefix

logger = logging.getLogger("prefixkv.replicas")
EVENTS_TOPIC = "kv-events"


def torch_threads(args: argparse.Namespace) -> int:
    if args.replica_torch_threads:
        return int(args.replica_torch_threads)
    return max(1, (os.cpu_count() or 1) // max(1, int(args.replicas)))


class EngineReplica:
    """The body of each engine deployment (wrapped by serve.deployment in app.py)."""

    def __init__(self, args: argparse.Namespace, replica_index: int) -> None:
        torch.set_num_threads(torch_threads(args))
        self.replica_index = replica_index
        args = copy.copy(args)
        # The events carry every prompt's token ids: bound on the server's --host (loopback by
        # default), not every interface, on ports the kernel picks at bind time (port "*"; no
        # port found free, released, then raced for).
        bind_host = event_bind_host(getattr(args, "host", None))
        args.kv_events_config = json.dumps(
            {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": tcp_endpoint(bind_host, "*"),
                "replay_endpoint": tcp_endpoint(bind_host, "*"),
                "topic": EVENTS_TOPIC,
            }
        )
        config = EngineArgs.from_cli_args(args)
        self.engine = LLMEngine(config)
        publisher = self.engine.kv_event_publisher
        assert isinstance(publisher, ZmqEventPublisher)
        pub_endpoint, replay_endpoint = publisher.endpoints
        assert replay_endpoint is not None
        self.pub_port = int(pub_endpoint.rsplit(":", 1)[1])
        self.replay_port = int(replay_endpoint.rsplit(":", 1)[1])
        node_ip = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        model_name = config.model or DEFAULT_MODEL_NAME
        # the very app single-engine serve runs; no periodic stats line (the ingress aggregates /metrics)
        # its Responses ids name it (resp_r<index>_...): the router sends a chained turn back here
        self.app = app_from_args(
            args, self.engine, model_name, log_stats=False, response_id_prefix=response_id_prefix(replica_index)
        )
        self.async_engine = self.app.state.async_engine
        self.async_engine.start()  # the app's lifespan would; the bridge calls the routes directly
        manager = self.engine.kv_cache_manager
        self._info = {
            "replica": replica_index,
            "actor_name": ray.get_runtime_context().get_actor_name(),
            "actor_id": ray.get_runtime_context().get_actor_id(),
            "node_ip": node_ip,
            # where the ingress subscribes: the bound host, or the node's address when bound on every interface
            "events_host": node_ip if bind_host == "*" else bind_host,
            "pub_endpoint": pub_endpoint,
            "replay_endpoint": replay_endpoint,
            "pub_port": self.pub_port,
            "replay_port": self.replay_port,
            "topic": EVENTS_TOPIC,
            "block_size": config.block_size,
            "num_blocks": self.engine.num_blocks,
            "hash_algo": config.prefix_caching_hash_algo if isinstance(config.prefix_caching_hash_algo, str) else "",
            "root_hash": manager.none_hash,
        }
        logger.info("engine replica %d ready: %s", replica_index, self._info)

    # -- control plane (plain handle calls) ----------------------------------------------------
    def info(self) -> dict[str, Any]:
        return dict(self._info)

    def load(self) -> dict[str, Any]:
        """vLLM's gauges: requests waiting, running, KV usage (read without stopping the engine
        thread: a poll may be one step old). `actor_id` lets the router notice a restart."""
        scheduler = self.engine.scheduler
        return {
            "waiting": len(scheduler.waiting),
            "running": len(scheduler.running),
            "kv_usage": float(self.engine.kv_cache_usage),
            "actor_id": self._info["actor_id"],
        }

    def metrics(self) -> bytes:
        rendered: bytes = self.app.state.metrics.render()
        return rendered

    async def lora_block_key(self, name: str) -> tuple[str, str, str, str] | None:
        """The extra key the engine puts on every block of a request naming adapter `name`
        (lora_extra_key(): "lora", name, path, digest), so the router can hash LoRA prompts as the
        engine does; None when `name` is not a loaded adapter."""
        loras = getattr(self.app.state, "loras", None)
        lora = loras.get(name) if loras is not None else None
        if lora is None:
            return None
        resolved, _ = await self.async_engine.call(lambda engine: engine.resolve_lora(lora))
        return lora_extra_key(resolved)

    def check_health(self) -> None:
        """Serve's health probe: a stopped engine loop makes the replica unhealthy (restarted)."""
        if not self.async_engine.is_running:
            raise RuntimeError(f"engine replica {self.replica_index}: the engine loop is not running")

    # -- data plane (a streaming handle call) ----------------------------------------------------
    async def handle_http(
        self, method: str, path: str, query: str, headers: list[tuple[str, str]], body: bytes
    ) -> AsyncIterator[dict[str, Any] | bytes]:
        async for message in call_asgi(self.app, method, path, query, headers, body):
            yield message

    def __del__(self) -> None:
        try:
            self.async_engine.shutdown(timeout=2.0)
            self.engine.shutdown()
        except Exception:
            pass
