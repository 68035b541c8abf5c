"""The ingress: one OpenAI-compatible endpoint in front of N engine replicas, routing each request.

Why a proxy deployment holding one handle per engine, not Ray Serve's custom request router: the
router here needs the request's *token* prefix (tokenized and chat-templated, then hashed as the
engines hash blocks), an index fed by ZeroMQ KV events, and its own in-flight counts; a Serve
request router is handed opaque pending requests and replica ids, and every engine deployment
would then be one deployment whose replicas Serve scales and names. With a deployment per engine
(num_replicas=1 each) the router holds N stable handles, chooses with prefixkv's own policies
(prefixkv/router), and relays the engine's response as it streams.

Per request (POST /v1/completions, /v1/chat/completions):
  1. hash the prompt's full blocks (prompt_hashes.py; in a worker thread);
  2. choose among the replicas that are up: round-robin, prefix or prefix-load (prefixkv/router/policy.py)
     over loads = (queue: requests sent and not yet answered with a first byte, or the engine's
     waiting count if larger; running; KV usage from the last poll);
  3. record the request in the index (events mode: a pending entry until its first byte; approx:
     the blocks it sent), call the replica's `handle_http` as a stream;
  4. hold the response until its first body byte: if the replica dies before that, mark it down
     and try another (up to --router-retries), since the client has seen nothing. A non-streamed
     response is held whole, so it is always retried. A stream cut after its first byte ends with
     an OpenAI error event and `data: [DONE]`.
Other routes go to the least-loaded replica that is up; /reset_prefix_cache and the LoRA
load / unload routes go to every replica; /health is 200 while one replica is up; /metrics
merges every replica's text under replica="i" with the router's own counters.

A poll task probes each replica's actor (a dead one fails at once, while a call through the
Serve handle would wait for Serve's replacement) and asks for its load every
--router-poll-interval seconds; a replica whose calls fail, or that leaves MAX_MISSED_POLLS polls
in a row unanswered, is down (its index entries forgotten at once). When it answers again - Serve
restarted it: a new actor id - the index starts it from nothing and subscribes to its new events,
after the run-time LoRA loads / unloads the other replicas took are replayed on it (in order).
A request naming a LoRA adapter is hashed with the adapter's block key, asked of a replica once
per adapter and forgotten at every load / unload.
"""

import argparse
import asyncio
import contextlib
import ipaddress
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, NodeDiedError, RayActorError, WorkerCrashedError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

from ..engine_args import EngineArgs
from ..kv_events.wire import ExternalBlockHash
from ..model import default_model_path
from ..model.loader import load_tokenizer
from ..router import PrefixIndex, ReplicaLoad, make_router
from ..server.app import DEFAULT_MODEL_NAME
from ..server.errors import error_body
from ..server.launch import api_keys_of
from .args import router_knobs
from .event_feed import EventFeed
from .metrics_merge import merge_expositions
from .prompt_hashes import ROUTED_PATHS, LoRAKey, PromptHasher

logger = logging.getLogger("prefixkv.replicas")

# The replica (its actor, node or worker) is gone or not reachable: the request never ran to the end there
REPLICA_GONE = (
    RayActorError,
    ActorUnavailableError,
    WorkerCrashedError,
    NodeDiedError,
    ReplicaUnavailableError,
    DeploymentUnavailableError,
)
LORA_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
BROADCAST_PATHS = ("/reset_prefix_cache", *LORA_PATHS)
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "host", "content-length"}
POLL_TIMEOUT_S = 2.0
LIVENESS_PROBE_AFTER_S = 0.5  # a request's first message slower than this: is its replica alive?
REPLAY_TIMEOUT_S = 60.0  # one LoRA load replayed on a restarted replica (reads and checks the folder)
MAX_MISSED_POLLS = 15  # consecutive unanswered polls (~30 s) before a silent replica is taken out

fastapi_app = FastAPI(title="prefixkv replicas")


@dataclass
class Replica:
    index: int
    handle: Any  # DeploymentHandle of engine-<index>
    up: bool = False
    actor_id: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    queued: int = 0  # sent by this ingress, no first byte back yet
    running: int = 0  # first byte back, not finished
    waiting_polled: int = 0
    running_polled: int = 0
    kv_usage: float = 0.0
    routed: int = 0
    failures: int = 0
    missed_polls: int = 0
    feed_task: asyncio.Task[None] | None = None
    actor: Any = None  # the replica's Ray actor (liveness probe), None if it could not be looked up
    lora_ops_applied: int = 0  # how many of the router's run-time LoRA loads / unloads this actor has had

    def load(self) -> ReplicaLoad:
        return ReplicaLoad(
            queue=max(self.queued, self.waiting_polled),
            running=max(self.running, self.running_polled),
            kv_usage=self.kv_usage,
        )


async def _actor_of(info: dict[str, Any]) -> Any:
    """The Ray actor behind a Serve replica, by the name it reported; None when it is gone already."""
    try:
        return await asyncio.to_thread(ray.get_actor, info["actor_name"], "serve")
    except Exception:
        return None


class ActorProbeFailed(Exception):
    """The replica's actor did not answer a liveness probe with anything but an error."""


class ReplicaGone(Exception):
    """The chosen replica died or vanished before the response started (retry elsewhere)."""


class Router:
    """The ingress's state, apart from Serve: replicas, index, policy, poll loop."""

    def __init__(self, args: argparse.Namespace, handles: list[Any]) -> None:
        self.args = args
        self.replicas = [Replica(i, h) for i, h in enumerate(handles)]
        self.mode = args.router_index
        self.index: PrefixIndex | None = None
        self.policy = make_router(args.router, None) if args.router == "round-robin" else None
        self.hasher: PromptHasher | None = None
        self.retries = 0
        self.events_applied = 0
        self._start_task: asyncio.Task[None] | None = None
        self._request_seq = 0
        self.base_names: set[str] = set()  # the base model's served names (set at start)
        # Run-time /v1/load_lora_adapter and /v1/unload_lora_adapter calls that some replica took, in
        # order: a restarted replica gets them all again before it is routed to. All of them, not the
        # final set: an adapter's cache identity counts its unloads, and replaying the same calls
        # gives the restarted replica the same identities (hence block hashes) as its peers.
        self.lora_ops: list[tuple[Any, ...]] = []
        self.lora_lock = asyncio.Lock()  # a broadcast and a replay never interleave
        self.lora_keys: dict[str, LoRAKey] = {}  # adapter name -> its block key, until the next load / unload
        self.lora_generation = 0  # bumped by every load / unload: a key asked for before it is not cached

    # -- start-up ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Awaited by every route: the first call (on the serving loop) learns the replicas, builds
        the hasher and index and starts polling; a failed start is tried again by the next call."""
        if self._start_task is None or (self._start_task.done() and self._start_task.exception() is not None):
            self._start_task = asyncio.get_running_loop().create_task(self._start())
        await asyncio.shield(self._start_task)

    def start_soon(self) -> None:
        if self._start_task is None:
            self._start_task = asyncio.get_running_loop().create_task(self._start())

    async def _start(self) -> None:
        infos = await asyncio.gather(*(r.handle.info.remote() for r in self.replicas))
        first = infos[0]
        config = EngineArgs.from_cli_args(self.args)
        self.base_names = set(self.args.served_model_name or [config.model or DEFAULT_MODEL_NAME])  # as the replicas
        if self.args.router != "round-robin":
            tokenizer_path = config.tokenizer or config.model or default_model_path()
            tokenizer = await asyncio.to_thread(load_tokenizer, tokenizer_path)
            if getattr(self.args, "chat_template", None):
                tokenizer.set_chat_template(self.args.chat_template)
            approx = self.mode == "approx"
            algo = "sha256_cbor" if approx else first["hash_algo"]
            self.hasher = PromptHasher(tokenizer, first["block_size"], algo)
            if not approx and self.hasher.root != first["root_hash"]:
                raise RuntimeError("the router's root block hash differs from the replicas' (hash seed?)")
            self.index = PrefixIndex(self.mode, approx_capacity_blocks=first["num_blocks"] if approx else None)
            self.policy = make_router(self.args.router, self.index, **router_knobs(self.args))
        for r, info in zip(self.replicas, infos):
            self._join(r, info, await _actor_of(info))
        asyncio.get_running_loop().create_task(self._poll_forever())

    @staticmethod
    def _check_reachable(r: Replica, host: str, node_ip: str) -> None:
        """A replica on another node of the cluster bound its events on its own loopback (--host is
        loopback): this ingress cannot subscribe, so the router's index stays without its events.
        Said once per join rather than left to a silent miss."""
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            return
        here = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        if loopback and node_ip != here:
            logger.warning(
                "engine replica %d runs on node %s but publishes its KV events on its loopback (--host %s): "
                "the router cannot read them from node %s; give --host an address the nodes reach "
                "(e.g. 0.0.0.0) for the precise index",
                r.index,
                node_ip,
                host,
                here,
            )

    def _join(self, r: Replica, info: dict[str, Any], actor: Any) -> None:
        """A replica (new, or restarted by Serve) is up: empty index entries, subscribe to its events."""
        r.actor = actor
        if r.feed_task is not None:
            r.feed_task.cancel()
            r.feed_task = None
        r.info, r.actor_id, r.up = info, info["actor_id"], True
        r.queued = r.running = r.missed_polls = 0
        if self.index is None:
            return
        self.index.remove_replica(r.index)
        self.index.add_replica(r.index)
        if self.mode != "approx":
            host = info.get("events_host", info["node_ip"])
            self._check_reachable(r, host, info["node_ip"])
            feed = EventFeed(self.index, r.index, host, info["pub_port"], info["replay_port"], info["topic"])
            r.feed_task = asyncio.get_running_loop().create_task(feed.run())

    def _leave(self, r: Replica, why: str) -> None:
        if r.up:
            logger.warning("engine replica %d is down (%s): routing around it", r.index, why)
        r.up = False
        r.failures += 1
        if r.feed_task is not None:
            r.feed_task.cancel()
            r.feed_task = None
        if self.index is not None:
            self.index.remove_replica(r.index)

    async def _poll_one(self, r: Replica) -> None:
        if r.up and r.actor is not None:
            # A call through the Serve handle to a dead replica waits for Serve to start a new one;
            # a call to the actor itself fails at once, so death is seen within one poll.
            try:
                await asyncio.wait_for(r.actor.__ray_ready__.remote(), POLL_TIMEOUT_S)
            except TimeoutError:
                pass
            except Exception as e:
                self._leave(r, type(e).__name__)
                return
        try:
            load = await asyncio.wait_for(r.handle.load.remote(), POLL_TIMEOUT_S)
        except TimeoutError:
            # slow is not dead: a replica busy on a long prefill on a loaded machine answers late.
            # A dead one fails its calls (RayActorError); only a long silence takes it out.
            r.missed_polls += 1
            if r.missed_polls >= MAX_MISSED_POLLS:
                self._leave(r, f"no answer to {r.missed_polls} polls")
            return
        except Exception as e:  # dead, or Serve has no replica for it: not a routing target
            self._leave(r, type(e).__name__)
            return
        r.missed_polls = 0
        if load["actor_id"] != r.actor_id or not r.up:
            try:
                info = await asyncio.wait_for(r.handle.info.remote(), POLL_TIMEOUT_S)
            except TimeoutError:
                return  # asked again at the next poll
            except Exception as e:
                self._leave(r, type(e).__name__)
                return
            if info["actor_id"] != r.actor_id:
                r.lora_ops_applied = 0  # a new actor: started from its flags alone
            if not await self.replay_lora_ops(r):
                return  # tried again at the next poll; not routed to meanwhile
            logger.info("engine replica %d is up (actor %s)", r.index, info["actor_id"])
            self._join(r, info, await _actor_of(info))
        r.waiting_polled, r.running_polled, r.kv_usage = load["waiting"], load["running"], load["kv_usage"]

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.args.router_poll_interval)
            await asyncio.gather(*(self._poll_one(r) for r in self.replicas), return_exceptions=True)

    # -- LoRA adapters ---------------------------------------------------------------------------
    async def replay_lora_ops(self, r: Replica) -> bool:
        """Send `r` the run-time LoRA loads / unloads it has not had; False if it failed to answer."""
        async with self.lora_lock:
            for call in self.lora_ops[r.lora_ops_applied :]:
                try:
                    status, content = await asyncio.wait_for(self.call_whole(r, call), REPLAY_TIMEOUT_S)
                except Exception as e:
                    logger.warning("engine replica %d: replaying %s failed (%s)", r.index, call[1], type(e).__name__)
                    return False
                if status >= 400:  # e.g. the adapter's folder is gone: the peers keep it, this one cannot
                    logger.warning("engine replica %d: replaying %s: %d %s", r.index, call[1], status, content[:200])
                r.lora_ops_applied += 1
            return True

    async def call_whole(self, r: Replica, call: tuple[Any, ...]) -> tuple[int, bytes]:
        """One HTTP call on `r` through its handle, bypassing the index and load counts."""
        gen = r.handle.options(stream=True).handle_http.remote(*call)
        head = await gen.__anext__()
        chunks = [chunk async for chunk in gen]
        return int(head["status"]), b"".join(chunks)

    async def lora_key(self, name: str) -> LoRAKey | None:
        """The block key of adapter `name`, asked of a replica once per adapter (they agree: same
        folders, same load / unload history); None when it is no adapter or no replica answered."""
        key = self.lora_keys.get(name)
        if key is not None:
            return key
        r = self.least_loaded()
        if r is None:
            return None
        generation = self.lora_generation
        try:
            got = await asyncio.wait_for(r.handle.lora_block_key.remote(name), POLL_TIMEOUT_S)
        except Exception:  # slow or gone: this request is routed by load
            return None
        if got is None:
            return None  # not cached: any string can be a `model`
        key = (str(got[0]), str(got[1]), str(got[2]), str(got[3]))
        if generation == self.lora_generation:  # else a load / unload raced the question: ask again next time
            self.lora_keys[name] = key
        return key

    async def request_hashes(self, path: str, body: bytes) -> list[ExternalBlockHash]:
        """The block hashes of a routed request's prompt ([] when they cannot be known here)."""
        hasher = self.hasher
        if hasher is None:
            return []
        try:
            parsed = json.loads(body)
        except ValueError:  # the replica answers the 400
            return []
        if not isinstance(parsed, dict):
            return []
        model = parsed.get("model")
        key = None
        if isinstance(model, str) and model not in self.base_names:
            key = await self.lora_key(model)
            if key is None:  # an unknown model (the replica answers 404) or no answer: by load
                return []
        return await asyncio.to_thread(hasher.hashes, path, parsed, key)  # off the event loop

    # -- choice --------------------------------------------------------------------------------
    def choose(self, hashes: list[ExternalBlockHash], exclude: set[int]) -> Replica | None:
        live = [r for r in self.replicas if r.up and r.index not in exclude]
        if not live:
            return None
        assert self.policy is not None
        i = self.policy.choose(hashes, [r.index for r in live], [r.load() for r in live])
        return live[i]

    def least_loaded(self) -> Replica | None:
        live = [r for r in self.replicas if r.up]
        if not live:
            return None
        return min(live, key=lambda r: (r.load().queue, r.load().running, r.routed))

    # -- one request ---------------------------------------------------------------------------
    async def open(
        self, r: Replica, hashes: list[ExternalBlockHash], call: tuple[Any, ...]
    ) -> tuple[dict[str, Any], list[bytes], AsyncIterator[Any], int]:
        """Send to `r`; wait for the status and the first body chunk (or the end). Raises ReplicaGone."""
        self._request_seq += 1
        rid = self._request_seq
        if self.index is not None and hashes:
            if self.mode == "approx":
                self.index.record_sent(r.index, hashes)
            else:
                self.index.add_pending(r.index, rid, hashes)
        r.queued += 1
        r.routed += 1
        gen = r.handle.options(stream=True).handle_http.remote(*call)
        try:
            head = await self._next_while_alive(r, gen)
            first: list[bytes] = []
            with contextlib.suppress(StopAsyncIteration):
                first.append(await self._next_while_alive(r, gen))
        except (*REPLICA_GONE, ActorProbeFailed) as e:
            gen.cancel()
            self._leave(r, type(e).__name__)
            raise ReplicaGone(str(e)) from e
        except BaseException:
            gen.cancel()
            raise
        finally:
            r.queued -= 1
            if self.index is not None and self.mode != "approx":
                self.index.resolve_pending(rid)
        return head, first, gen, rid

    async def _next_while_alive(self, r: Replica, gen: Any) -> Any:
        """The stream's next message. A call sent to a replica that has just died is held by the
        Serve handle until Serve has started its replacement (seconds to minutes: a model loads),
        so while the message is slow to come, the actor itself is probed; a dead one fails here,
        and the request goes elsewhere."""
        nxt = asyncio.ensure_future(gen.__anext__())
        try:
            while True:
                done, _ = await asyncio.wait({nxt}, timeout=LIVENESS_PROBE_AFTER_S)
                if done:
                    return nxt.result()
                if r.actor is None:
                    continue
                try:
                    await asyncio.wait_for(r.actor.__ray_ready__.remote(), POLL_TIMEOUT_S)
                except TimeoutError:
                    continue  # busy, not dead
                except Exception as e:
                    raise ActorProbeFailed(f"engine replica {r.index}: {type(e).__name__}") from e
        finally:
            if not nxt.done():
                nxt.cancel()


def _headers(head: dict[str, Any]) -> dict[str, str]:
    return {k: v for k, v in head["headers"] if k.lower() not in HOP_BY_HOP}


def _sse_error(message: str, status: int) -> bytes:
    return f"data: {json.dumps(error_body(message, status))}\n\ndata: [DONE]\n\n".encode()


@serve.ingress(fastapi_app)
class Ingress:
    def __init__(self, args: argparse.Namespace, engines: list[Any]) -> None:
        self.router = Router(args, engines)
        self.args = args

    async def check_health(self) -> None:
        self.router.start_soon()  # the controller's first probe starts the poll loop even without traffic

    # -- aggregated routes ------------------------------------------------------------------------
    @fastapi_app.get("/health")
    async def health(self) -> Response:
        await self.router.start()
        if not any(r.up for r in self.router.replicas):
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
        await self.router.start()
        live = [r for r in self.router.replicas if r.up]
        texts = await asyncio.gather(
            *(asyncio.wait_for(r.handle.metrics.remote(), POLL_TIMEOUT_S) for r in live), return_exceptions=True
        )
        parts = [(str(r.index), t.decode()) for r, t in zip(live, texts) if isinstance(t, bytes)]
        parts.append(("router", self._router_metrics()))
        return Response(merge_expositions(parts), media_type="text/plain; version=0.0.4; charset=utf-8")

    def _router_metrics(self) -> str:
        """The router's own families; merge_expositions adds replica="router" to the unlabelled ones."""
        lines = [
            "# HELP prefixkv:router_requests_total Requests the router sent to each engine replica.",
            "# TYPE prefixkv:router_requests_total counter",
        ]
        lines += [f'prefixkv:router_requests_total{{engine="{r.index}"}} {r.routed}' for r in self.router.replicas]
        lines += [
            "# HELP prefixkv:router_replica_up Whether the router routes to the engine replica (1) or not (0).",
            "# TYPE prefixkv:router_replica_up gauge",
        ]
        lines += [f'prefixkv:router_replica_up{{engine="{r.index}"}} {int(r.up)}' for r in self.router.replicas]
        lines += [
            "# HELP prefixkv:router_replica_failures_total Times an engine replica was found dead or unreachable.",
            "# TYPE prefixkv:router_replica_failures_total counter",
        ]
        lines += [
            f'prefixkv:router_replica_failures_total{{engine="{r.index}"}} {r.failures}' for r in self.router.replicas
        ]
        if self.router.index is not None:
            lines += [
                "# HELP prefixkv:router_index_blocks Blocks the router's index believes each replica caches.",
                "# TYPE prefixkv:router_index_blocks gauge",
            ]
            lines += [
                f'prefixkv:router_index_blocks{{engine="{r.index}"}} {self.router.index.num_blocks(r.index)}'
                for r in self.router.replicas
            ]
        lines += [
            "# HELP prefixkv:router_retries_total Requests sent again to another replica after theirs died.",
            "# TYPE prefixkv:router_retries_total counter",
            f"prefixkv:router_retries_total {self.router.retries}",
        ]
        return "\n".join(lines) + "\n"

    # -- everything else: proxied -------------------------------------------------------------------
    @fastapi_app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def proxy(self, request: Request) -> Response:
        router = self.router
        await router.start()
        body = await request.body()
        path = "/" + request.path_params["path"].lstrip("/")
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in ("connection", "keep-alive")]
        call = (request.method, path, request.url.query, headers, body)
        if path in BROADCAST_PATHS:
            return await self._broadcast(call)
        hashes: list[ExternalBlockHash] = []
        if path in ROUTED_PATHS and request.method == "POST":
            hashes = await router.request_hashes(path, body)
        routed = path in ROUTED_PATHS
        tried: set[int] = set()
        t0 = time.monotonic()
        for _ in range(1 + self.args.router_retries):
            r = router.choose(hashes, tried) if routed else router.least_loaded()
            if r is None:
                break
            tried.add(r.index)
            try:
                head, first, gen, _rid = await router.open(r, hashes, call)
            except ReplicaGone:
                router.retries += 1
                continue
            return await self._respond(r, head, first, gen, call)
        waited = time.monotonic() - t0
        return JSONResponse(
            error_body(f"no engine replica could take the request (tried {len(tried)}, {waited:.1f}s)", 503),
            status_code=503,
        )

    async def _respond(
        self, r: Replica, head: dict[str, Any], first: list[bytes], gen: Any, call: tuple[Any, ...]
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
                self.router._leave(r, type(e).__name__)
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
                self.router._leave(r, type(e).__name__)
                yield _sse_error(f"engine replica {r.index} died mid-stream; the response is incomplete", 503)
            finally:
                r.running -= 1
                gen.cancel()  # no-op when finished; stops the replica's route when the client left

        return StreamingResponse(relay(), status_code=head["status"], headers=headers)

    async def _broadcast(self, call: tuple[Any, ...]) -> Response:
        """Every replica that is up does it; the first failure's answer wins, else the last success.
        A LoRA load / unload that some replica took is remembered (replayed on restarted replicas)
        and drops the router's cached adapter keys."""
        router = self.router
        lora = call[1] in LORA_PATHS
        async with router.lora_lock if lora else contextlib.nullcontext():
            live = [r for r in router.replicas if r.up]
            if not live:
                return JSONResponse(error_body("no engine replica is up", 503), status_code=503)
            answers = []
            took = []
            for r in live:
                try:
                    head, first, gen, _ = await router.open(r, [], call)
                except ReplicaGone:
                    continue
                chunks = list(first)
                async for chunk in gen:
                    chunks.append(chunk)
                answers.append((head, b"".join(chunks)))
                took.append(r)
            if lora:
                router.lora_keys.clear()
                router.lora_generation += 1
                if any(head["status"] < 400 for head, _ in answers):
                    router.lora_ops.append(call)
                    for r in took:
                        r.lora_ops_applied = len(router.lora_ops)
        if not answers:
            return JSONResponse(error_body("no engine replica is up", 503), status_code=503)
        head, content = next((a for a in answers if a[0]["status"] >= 400), answers[-1])
        return Response(content, status_code=head["status"], headers=_headers(head))
