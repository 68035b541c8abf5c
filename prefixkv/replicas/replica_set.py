"""The engine replicas behind the ingress: which are up, their loads, and their run-time LoRA state.

A poll task probes each replica's actor (a dead one fails at once, while a call through the
Serve handle would wait for Serve's replacement) and asks for its load every poll interval; a
replica whose calls fail, or that leaves MAX_MISSED_POLLS polls in a row unanswered, is down.
When it answers again - Serve restarted it: a new actor id - the run-time LoRA loads / unloads
the other replicas took are replayed on it (in order) before it counts as up again. Each join and
leave is told to a MembershipListener (the ReplicaChooser: it keeps the prefix index in step).

A request naming a LoRA adapter is hashed with the adapter's block key: asked of a replica once
per adapter (`adapter_key`) and forgotten at every load / unload.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

import ray
from ray.exceptions import ActorUnavailableError, NodeDiedError, RayActorError, WorkerCrashedError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

from ..router import ReplicaLoad
from .prompt_hashes import LoRABlockKey

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
POLL_TIMEOUT_S = 2.0
LIVENESS_PROBE_AFTER_S = 0.5  # a request's first message slower than this: is its replica alive?
REPLAY_TIMEOUT_S = 60.0  # one LoRA load replayed on a restarted replica (reads and checks the folder)
MAX_MISSED_POLLS = 15  # consecutive unanswered polls (~30 s) before a silent replica is taken out

# (method, path, query, headers, body): one HTTP request as EngineReplica.handle_http takes it
HttpCall = tuple[Any, ...]


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
    actor: Any = None  # the replica's Ray actor (liveness probe), None if it could not be looked up
    lora_ops_applied: int = 0  # how many of the ingress's run-time LoRA loads / unloads this actor has had

    def load(self) -> ReplicaLoad:
        return ReplicaLoad(
            queue=max(self.queued, self.waiting_polled),
            running=max(self.running, self.running_polled),
            kv_usage=self.kv_usage,
        )


class MembershipListener(Protocol):
    def joined(self, replica: Replica) -> None:
        """`replica` is up (new, or restarted by Serve); its `info` is the one it reported."""

    def left(self, replica: Replica) -> None:
        """`replica` is down: nothing is routed there until it joins again."""


class ActorProbeFailed(Exception):
    """The replica's actor did not answer a liveness probe with anything but an error."""


class ReplicaGone(Exception):
    """The chosen replica died or vanished before the response started (retry elsewhere)."""


async def _actor_of(info: dict[str, Any]) -> Any:
    """The Ray actor behind a Serve replica, by the name it reported; None when it is gone already."""
    try:
        return await asyncio.to_thread(ray.get_actor, info["actor_name"], "serve")
    except Exception:
        return None


async def describe(handles: list[Any]) -> list[dict[str, Any]]:
    """Every replica's `info()`, in order (waits until each has started)."""
    return list(await asyncio.gather(*(h.info.remote() for h in handles)))


class ReplicaSet:
    """Membership of the engine replicas: joins, leaves, the poll loop and the run-time LoRA log."""

    def __init__(self, handles: list[Any], poll_interval: float, listener: MembershipListener) -> None:
        self.replicas = [Replica(i, h) for i, h in enumerate(handles)]
        self.poll_interval = poll_interval
        self._listener = listener
        self._poll_task: asyncio.Task[None] | None = None
        # Run-time /v1/load_lora_adapter and /v1/unload_lora_adapter calls that some replica took, in
        # order: a restarted replica gets them all again before it is routed to. All of them, not the
        # final set: an adapter's cache identity counts its unloads, and replaying the same calls
        # gives the restarted replica the same identities (hence block hashes) as its peers.
        self._lora_ops: list[HttpCall] = []
        self._lora_lock = asyncio.Lock()  # a broadcast and a replay never interleave
        self._adapter_keys: dict[str, LoRABlockKey] = {}  # adapter name -> its block key, until the next load / unload
        self._lora_generation = 0  # bumped by every load / unload: a key asked for before it is not cached

    async def start(self, infos: list[dict[str, Any]]) -> None:
        """Join every replica as described by `infos` (describe()), then poll them forever."""
        for r, info in zip(self.replicas, infos):
            self._join(r, info, await _actor_of(info))
        self._poll_task = asyncio.get_running_loop().create_task(self._poll_forever())

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.up]

    def live_one(self, index: int) -> Replica | None:
        """Replica `index` if it is up."""
        r = self.replicas[index] if 0 <= index < len(self.replicas) else None
        return r if r is not None and r.up else None

    def least_loaded(self) -> Replica | None:
        live = self.live()
        if not live:
            return None
        return min(live, key=lambda r: (r.load().queue, r.load().running, r.routed))

    # -- membership ------------------------------------------------------------------------------
    def _join(self, r: Replica, info: dict[str, Any], actor: Any) -> None:
        r.actor = actor
        r.info, r.actor_id, r.up = info, info["actor_id"], True
        r.queued = r.running = r.missed_polls = 0
        self._listener.joined(r)

    def leave(self, r: Replica, why: str) -> None:
        """`r` failed a call or a probe: routed around until it answers a poll again."""
        if r.up:
            logger.warning("engine replica %d is down (%s): routing around it", r.index, why)
        r.up = False
        r.failures += 1
        self._listener.left(r)

    async def _probe(self, r: Replica) -> None:
        """Raise if `r`'s actor is dead; return when it answers or is only slow."""
        with contextlib.suppress(TimeoutError):  # busy, not dead
            await asyncio.wait_for(r.actor.__ray_ready__.remote(), POLL_TIMEOUT_S)

    async def _poll_one(self, r: Replica) -> None:
        if r.up and r.actor is not None:
            # A call through the Serve handle to a dead replica waits for Serve to start a new one;
            # a call to the actor itself fails at once, so death is seen within one poll.
            try:
                await self._probe(r)
            except Exception as e:
                self.leave(r, type(e).__name__)
                return
        try:
            load = await asyncio.wait_for(r.handle.load.remote(), POLL_TIMEOUT_S)
        except TimeoutError:
            # slow is not dead: a replica busy on a long prefill on a loaded machine answers late.
            # A dead one fails its calls (RayActorError); only a long silence takes it out.
            r.missed_polls += 1
            if r.missed_polls >= MAX_MISSED_POLLS:
                self.leave(r, f"no answer to {r.missed_polls} polls")
            return
        except Exception as e:  # dead, or Serve has no replica for it: not a routing target
            self.leave(r, type(e).__name__)
            return
        r.missed_polls = 0
        if load["actor_id"] != r.actor_id or not r.up:
            try:
                info = await asyncio.wait_for(r.handle.info.remote(), POLL_TIMEOUT_S)
            except TimeoutError:
                return  # asked again at the next poll
            except Exception as e:
                self.leave(r, type(e).__name__)
                return
            if info["actor_id"] != r.actor_id:
                r.lora_ops_applied = 0  # a new actor: started from its flags alone
            if not await self._replay_lora_ops(r):
                return  # tried again at the next poll; not routed to meanwhile
            logger.info("engine replica %d is up (actor %s)", r.index, info["actor_id"])
            self._join(r, info, await _actor_of(info))
        r.waiting_polled, r.running_polled, r.kv_usage = load["waiting"], load["running"], load["kv_usage"]

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval)
            await asyncio.gather(*(self._poll_one(r) for r in self.replicas), return_exceptions=True)

    # -- one request -------------------------------------------------------------------------------
    async def open(self, r: Replica, call: HttpCall) -> tuple[dict[str, Any], list[bytes], Any]:
        """Send `call` to `r`; wait for the status and the first body chunk (or the end). Returns
        (status and headers, the first chunk if any, the stream of the rest). Raises ReplicaGone."""
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
            self.leave(r, type(e).__name__)
            raise ReplicaGone(str(e)) from e
        except BaseException:
            gen.cancel()
            raise
        finally:
            r.queued -= 1
        return head, first, gen

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
                    await self._probe(r)
                except Exception as e:
                    raise ActorProbeFailed(f"engine replica {r.index}: {type(e).__name__}") from e
        finally:
            if not nxt.done():
                nxt.cancel()

    async def _call_whole(self, r: Replica, call: HttpCall) -> tuple[int, bytes]:
        """One HTTP call on `r` through its handle, bypassing the index and load counts."""
        gen = r.handle.options(stream=True).handle_http.remote(*call)
        head = await gen.__anext__()
        chunks = [chunk async for chunk in gen]
        return int(head["status"]), b"".join(chunks)

    # -- every replica, and LoRA adapters ----------------------------------------------------------
    async def _replay_lora_ops(self, r: Replica) -> bool:
        """Send `r` the run-time LoRA loads / unloads it has not had; False if it failed to answer."""
        async with self._lora_lock:
            for call in self._lora_ops[r.lora_ops_applied :]:
                try:
                    status, content = await asyncio.wait_for(self._call_whole(r, call), REPLAY_TIMEOUT_S)
                except Exception as e:
                    logger.warning("engine replica %d: replaying %s failed (%s)", r.index, call[1], type(e).__name__)
                    return False
                if status >= 400:  # e.g. the adapter's folder is gone: the peers keep it, this one cannot
                    logger.warning("engine replica %d: replaying %s: %d %s", r.index, call[1], status, content[:200])
                r.lora_ops_applied += 1
            return True

    async def broadcast(self, call: HttpCall, lora_op: bool) -> list[tuple[dict[str, Any], bytes]]:
        """`call` on every replica that is up, one after another: their whole answers (status and
        headers, body), [] when none is up or all died. A LoRA load / unload (`lora_op`) that some
        replica took is logged (replayed on replicas that join later); either way it drops the
        cached adapter keys."""
        async with self._lora_lock if lora_op else contextlib.nullcontext():
            live = self.live()
            if not live:
                return []
            answers = []
            took = []
            for r in live:
                try:
                    head, first, gen = await self.open(r, call)
                except ReplicaGone:
                    continue
                chunks = list(first)
                async for chunk in gen:
                    chunks.append(chunk)
                answers.append((head, b"".join(chunks)))
                took.append(r)
            if lora_op:
                self._adapter_keys.clear()
                self._lora_generation += 1
                if any(head["status"] < 400 for head, _ in answers):
                    self._lora_ops.append(call)
                    for r in took:
                        r.lora_ops_applied = len(self._lora_ops)
        return answers

    async def adapter_key(self, name: str) -> LoRABlockKey | None:
        """The block key of adapter `name`, asked of a replica once per adapter (they agree: same
        folders, same load / unload history); None when it is no adapter or no replica answered."""
        key = self._adapter_keys.get(name)
        if key is not None:
            return key
        r = self.least_loaded()
        if r is None:
            return None
        generation = self._lora_generation
        try:
            got = await asyncio.wait_for(r.handle.lora_block_key.remote(name), POLL_TIMEOUT_S)
        except Exception:  # slow or gone: this request is routed by load
            return None
        if got is None:
            return None  # not cached: any string can be a `model`
        key = (str(got[0]), str(got[1]), str(got[2]), str(got[3]))
        if generation == self._lora_generation:  # else a load / unload raced the question: ask again next time
            self._adapter_keys[name] = key
        return key
