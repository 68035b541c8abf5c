"""The ingress: one OpenAI-compatible endpoint in front of N engine replicas.

Why a proxy deployment holding one handle per engine, not Ray Serve's custom request router: the
choice here needs the request's *token* prefix (tokenized and chat-templated, then hashed as the
engines hash blocks), an index fed by ZeroMQ KV events, and its own in-flight counts; a Serve
request router is handed opaque pending requests and replica ids, and every engine deployment
would then be one deployment whose replicas Serve scales and names. With a deployment per engine
(num_replicas=1 each) the ingress holds N stable handles, keeps them in a ReplicaSet
(replica_set.py: membership, polls, LoRA replay), picks one per request with a ReplicaChooser
(chooser.py: prompt hashes, prefix index, prefixkv/router's policies), and relays the engine's
response as it streams.

A routed request (POST /v1/completions, /v1/chat/completions) is held until its first body byte:
if the replica dies before that, it is marked down and the request tried on another (up to
--router-retries), since the client has seen nothing. A non-streamed response is held whole, so
it is always retried. A stream cut after its first byte ends with an OpenAI error event and
`data: [DONE]`. Other routes go to the least-loaded replica that is up; /reset_prefix_cache and
the LoRA load / unload routes go to every replica; /health is 200 while one replica is up;
/metrics merges every replica's text under replica="i" with the router's own counters.
"""

import argparse
import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from ..kv_events.wire import ExternalBlockHash
from ..server.errors import error_body
from ..server.launch import api_keys_of
from .chooser import ReplicaChooser
from .metrics_merge import merge_expositions
from .prompt_hashes import ROUTED_PATHS
from .replica_set import POLL_TIMEOUT_S, REPLICA_GONE, HttpCall, Replica, ReplicaGone, ReplicaSet, describe
from .response_home import response_home

LORA_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
BROADCAST_PATHS = ("/reset_prefix_cache", *LORA_PATHS)
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "host", "content-length"}

fastapi_app = FastAPI(title="prefixkv replicas")


def _headers(head: dict[str, Any]) -> dict[str, str]:
    return {k: v for k, v in head["headers"] if k.lower() not in HOP_BY_HOP}


def _sse_error(message: str, status: int) -> bytes:
    return f"data: {json.dumps(error_body(message, status))}\n\ndata: [DONE]\n\n".encode()


def _router_metrics(replicas: ReplicaSet, chooser: ReplicaChooser, retries: int) -> str:
    """The router's own families; merge_expositions adds replica="router" to the unlabelled ones."""
    lines = [
        "# HELP prefixkv:router_requests_total Requests the router sent to each engine replica.",
        "# TYPE prefixkv:router_requests_total counter",
    ]
    lines += [f'prefixkv:router_requests_total{{engine="{r.index}"}} {r.routed}' for r in replicas.replicas]
    lines += [
        "# HELP prefixkv:router_replica_up Whether the router routes to the engine replica (1) or not (0).",
        "# TYPE prefixkv:router_replica_up gauge",
    ]
    lines += [f'prefixkv:router_replica_up{{engine="{r.index}"}} {int(r.up)}' for r in replicas.replicas]
    lines += [
        "# HELP prefixkv:router_replica_failures_total Times an engine replica was found dead or unreachable.",
        "# TYPE prefixkv:router_replica_failures_total counter",
    ]
    lines += [f'prefixkv:router_replica_failures_total{{engine="{r.index}"}} {r.failures}' for r in replicas.replicas]
    if chooser.index is not None:
        lines += [
            "# HELP prefixkv:router_index_blocks Blocks the router's index believes each replica caches.",
            "# TYPE prefixkv:router_index_blocks gauge",
        ]
        lines += [
            f'prefixkv:router_index_blocks{{engine="{r.index}"}} {chooser.index.num_blocks(r.index)}'
            for r in replicas.replicas
        ]
        lines += [
            "# HELP prefixkv:router_index_tier_blocks Blocks the router's index believes sit in a tier: each "
            'replica\'s own (engine=N) and the one every replica reads, such as a shared Redis (engine="shared").',
            "# TYPE prefixkv:router_index_tier_blocks gauge",
        ]
        lines += [
            f'prefixkv:router_index_tier_blocks{{engine="{r.index}"}} {chooser.index.num_tier_blocks(r.index)}'
            for r in replicas.replicas
        ]
        lines.append(f'prefixkv:router_index_tier_blocks{{engine="shared"}} {chooser.index.num_tier_blocks(None)}')
    lines += [
        "# HELP prefixkv:router_retries_total Requests sent again to another replica after theirs died.",
        "# TYPE prefixkv:router_retries_total counter",
        f"prefixkv:router_retries_total {retries}",
    ]
    return "\n".join(lines) + "\n"


@serve.ingress(fastapi_app)
class Ingress:
    def __init__(self, args: argparse.Namespace, engines: list[Any]) -> None:
        self.args = args
        self.engines = engines
        self.retries = 0  # requests sent again to another replica after theirs died
        self._start_task: asyncio.Task[tuple[ReplicaSet, ReplicaChooser]] | None = None

    async def _started(self) -> tuple[ReplicaSet, ReplicaChooser]:
        """Awaited by every route: the first call (on the serving loop) learns the replicas, builds
        the chooser and starts polling; a failed start is tried again by the next call."""
        if self._start_task is None or (self._start_task.done() and self._start_task.exception() is not None):
            self._start_task = asyncio.get_running_loop().create_task(self._start())
        return await asyncio.shield(self._start_task)

    async def _start(self) -> tuple[ReplicaSet, ReplicaChooser]:
        infos = await describe(self.engines)
        chooser = await ReplicaChooser.create(self.args, infos[0])
        replicas = ReplicaSet(self.engines, self.args.router_poll_interval, chooser)
        await replicas.start(infos)
        return replicas, chooser

    async def check_health(self) -> None:
        if self._start_task is None:  # the controller's first probe starts the poll loop even without traffic
            self._start_task = asyncio.get_running_loop().create_task(self._start())

    # -- aggregated routes ------------------------------------------------------------------------
    @fastapi_app.get("/health")
    async def health(self) -> Response:
        replicas, _ = await self._started()
        if not replicas.live():
            return JSONResponse(error_body("no engine replica is up", 503), status_code=503)
        return Response(status_code=200)

    @fastapi_app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        # as a single server's: with --require-cache-salt and an API key, /metrics needs the key
        # (prefixkv/server/app.py); without a key the replicas leave the per-item counters out
        keys = api_keys_of(self.args)
        if keys and getattr(self.args, "require_cache_salt", False):
            header = request.headers.get("authorization", "").encode()
            if not sum(secrets.compare_digest(header, f"Bearer {k}".encode()) for k in keys):
                message = "Unauthorized: a valid API key is required (Authorization: Bearer <key>)"
                return JSONResponse(error_body(message, 401, "AuthenticationError"), status_code=401)
        replicas, chooser = await self._started()
        live = replicas.live()
        texts = await asyncio.gather(
            *(asyncio.wait_for(r.handle.metrics.remote(), POLL_TIMEOUT_S) for r in live), return_exceptions=True
        )
        parts = [(str(r.index), t.decode()) for r, t in zip(live, texts) if isinstance(t, bytes)]
        parts.append(("router", _router_metrics(replicas, chooser, self.retries)))
        return Response(merge_expositions(parts), media_type="text/plain; version=0.0.4; charset=utf-8")

    # -- everything else: proxied -------------------------------------------------------------------
    @fastapi_app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def proxy(self, request: Request) -> Response:
        replicas, chooser = await self._started()
        body = await request.body()
        path = "/" + request.path_params["path"].lstrip("/")
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in ("connection", "keep-alive")]
        call = (request.method, path, request.url.query, headers, body)
        if path in BROADCAST_PATHS:
            return await self._broadcast(replicas, call)
        hashes: list[ExternalBlockHash] = []
        cache_key: str | None = None
        if path in ROUTED_PATHS and request.method == "POST":
            hashes, cache_key = await chooser.request_route(path, body, replicas.adapter_key)
        routed = path in ROUTED_PATHS
        home = response_home(request.method, path, body)  # a stored response lives on one replica
        tried: set[int] = set()
        t0 = time.monotonic()
        for _ in range(1 + self.args.router_retries):
            if home is not None and home not in tried and replicas.live_one(home) is not None:
                r = replicas.live_one(home)
            elif routed:
                r = chooser.choose(hashes, replicas.live(), tried, cache_key)
            else:
                r = replicas.least_loaded()
            if r is None:
                break
            tried.add(r.index)
            rid = chooser.sent(r, hashes)
            try:
                head, first, gen = await replicas.open(r, call)
            except ReplicaGone:
                self.retries += 1
                continue
            finally:
                chooser.answered(rid)
            return await self._respond(replicas, r, head, first, gen)
        waited = time.monotonic() - t0
        return JSONResponse(
            error_body(f"no engine replica could take the request (tried {len(tried)}, {waited:.1f}s)", 503),
            status_code=503,
        )

    async def _respond(
        self, replicas: ReplicaSet, r: Replica, head: dict[str, Any], first: list[bytes], gen: Any
    ) -> Response:
        headers = _headers(head)
        streaming = headers.get("content-type", "").startswith("text/event-stream")
        r.running += 1
        if not streaming:  # held whole: the client sees nothing until the end
            chunks = list(first)
            try:
                async for chunk in gen:
                    chunks.append(chunk)
            except REPLICA_GONE as e:
                replicas.leave(r, type(e).__name__)
                return JSONResponse(error_body(f"engine replica {r.index} died mid-response", 503), status_code=503)
            finally:
                r.running -= 1
            return Response(b"".join(chunks), status_code=head["status"], headers=headers)

        async def relay() -> AsyncIterator[bytes]:
            try:
                for chunk in first:
                    yield chunk
                async for chunk in gen:
                    yield chunk
            except REPLICA_GONE as e:
                replicas.leave(r, type(e).__name__)
                yield _sse_error(f"engine replica {r.index} died mid-stream; the response is incomplete", 503)
            finally:
                r.running -= 1
                gen.cancel()  # no-op when finished; stops the replica's route when the client left

        return StreamingResponse(relay(), status_code=head["status"], headers=headers)

    async def _broadcast(self, replicas: ReplicaSet, call: HttpCall) -> Response:
        """Every replica that is up does it; the first failure's answer wins, else the last success."""
        answers = await replicas.broadcast(call, lora_op=call[1] in LORA_PATHS)
        if not answers:
            return JSONResponse(error_body("no engine replica is up", 503), status_code=503)
        head, content = next((a for a in answers if a[0]["status"] >= 400), answers[-1])
        return Response(content, status_code=head["status"], headers=_headers(head))
