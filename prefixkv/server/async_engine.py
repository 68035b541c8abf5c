"""Run the (not thread-safe) LLMEngine in one thread beside the asyncio event loop.

`prefixkv serve` runs the engine loop on the main thread (`run()`) and the HTTP server in a
second thread: with torch's OpenMP pool, ops issued from a thread created after the main thread
has used torch run up to 2-7x slower here (a 4-sequence decode step: 67 ms against 35 ms; see
docs/serving.md). `start()` runs the loop in a background thread instead, for embedding the app
in another server.

Every engine call happens on the engine thread. Admission (`input_processor`: tokenization,
images, validation, grammars) touches no engine state, so the server runs it outside the loop;
the engine thread only registers the admitted request. The event loop talks to it through a command
queue that the thread drains between steps (add, abort, reset-prefix-cache), and outputs come
back through per-request asyncio queues fed with `loop.call_soon_threadsafe`. The thread waits on
a condition variable when it has nothing to do, so an idle server burns no CPU.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ..engine.llm_engine import LLMEngine
from ..outputs import RequestOutput
from ..request import MultiModalItem
from ..sampling_params import SamplingParams
from .errors import EngineDeadError

logger = logging.getLogger("prefixkv.server")
IDLE_EVENTS_POLL_S = 0.05  # while idle with tier saves in flight: how often their KV events are sent

__all__ = ["AsyncEngine", "EngineDeadError"]


@dataclass
class _Stream:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    finished: bool = False

    def put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    """On the event loop: a step's outputs into their streams' queues."""
    for queue, out in items:
        queue.put_nowait(out)


class AsyncEngine:
    """`generate()` is an async iterator of RequestOutputs for one request, as its params'
    output_kind says (cumulative by default, what the routes stream; FINAL_ONLY for what they do
    not stream: `OpenAIServing.start`); leaving it early
    (client gone, task cancelled) aborts the request, which frees its blocks at once."""

    def __init__(
        self,
        engine: LLMEngine,
        on_finished: Callable[[RequestOutput], None] | None = None,
        on_aborted: Callable[[], None] | None = None,
        on_step: Callable[[int, list[float]], None] | None = None,
    ) -> None:
        self.engine = engine
        self.input_processor = engine.input_processor  # thread-safe: used outside the engine thread
        self.default_sampling_params = engine.default_sampling_params  # the model's, fixed at start
        self.on_finished = on_finished
        # (tokens computed, inter-token latencies) after every step, on the engine thread
        self.on_step = on_step
        self.on_aborted = on_aborted
        self._cv = threading.Condition()
        self._commands: deque[tuple[Callable[[], Any], Callable[[Any, BaseException | None], None] | None]] = deque()
        self._streams: dict[str, _Stream] = {}
        self._stop = False
        self._thread: threading.Thread | None = None
        self.errored: BaseException | None = None
        self.last_step_time = 0.0
        self._running = False
        self._drain_deadline: float | None = None

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Run the engine loop in a background thread."""
        if self._thread is None and not self._running:
            self._running = True
            self._thread = threading.Thread(target=self.run, name="prefixkv-engine", daemon=True)
            self._thread.start()

    def run(self, keep_going: Callable[[], bool] | None = None) -> None:
        """Run the engine loop in the calling thread until shutdown() - or, if given, until
        keep_going() turns false (checked at least every half second while idle)."""
        self._running = True
        try:
            self._run(keep_going)
        finally:
            self._running = False
            tiers = getattr(self.engine, "tiers", None)
            if tiers is not None:  # queued saves reach the disk / Redis tier: a restart finds them
                tiers.flush()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def begin_drain(self, timeout: float) -> None:
        """Graceful shutdown: requests in flight may finish for `timeout` seconds; those still
        running then end with EngineDeadError (an error event in their stream, a 503 otherwise)."""
        with self._cv:
            if self._drain_deadline is None:
                self._drain_deadline = time.time() + timeout
            self._cv.notify_all()

    @property
    def is_draining(self) -> bool:
        return self._drain_deadline is not None

    @property
    def num_in_flight(self) -> int:
        """Requests the engine has and has not finished (streaming or not)."""
        return len(self._streams)

    @property
    def is_running(self) -> bool:
        return self._running and self.errored is None

    # -- engine thread ----------------------------------------------------------------------
    def _run(self, keep_going: Callable[[], bool] | None) -> None:
        engine = self.engine
        while True:
            with self._cv:
                while not self._stop and not self._commands and not engine.has_unfinished_requests():
                    if keep_going is not None and not keep_going():
                        self._stop = True
                        break
                    # idle, yet a tier's writer may still be saving the last requests' blocks: their
                    # events go out as they come (a router learns of the tier's blocks), not with the
                    # next request's first step
                    saving = engine.drain_kv_events()
                    self._cv.wait(IDLE_EVENTS_POLL_S if saving else 0.5 if keep_going is not None else None)
                if self._stop:
                    break
                commands = list(self._commands)
                self._commands.clear()
            if self._drain_deadline is not None and time.time() > self._drain_deadline and self._streams:
                logger.warning("shutdown timeout: ending %d request(s) still in flight", len(self._streams))
                self._fail_all(EngineDeadError("the server is shutting down; the request did not finish in time"))
            for fn, done in commands:
                try:
                    result, exc = fn(), None
                except BaseException as e:  # reported to the caller
                    result, exc = None, e
                if done is not None:
                    done(result, exc)
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # the engine aborted the failing batch; fail everything else too
                logger.exception("engine step failed")
                self._fail_all(e)
                continue
            self.last_step_time = time.time()
            if self.on_step is not None:
                try:
                    self.on_step(engine.last_step_num_tokens, engine.last_step_inter_token_latencies)
                except Exception:
                    logger.exception("metrics callback failed")
            # one hand-over per event loop and step, not one per output: each wakes the loop
            # through its self-pipe (a system call), 256 of them a step at batch 256
            deliveries: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if out.finished:
                    self._streams.pop(out.request_id, None)
                    if self.on_finished is not None:
                        try:
                            self.on_finished(out)
                        except Exception:
                            logger.exception("metrics callback failed")
                if stream is not None:
                    deliveries.setdefault(stream.loop, []).append((stream.queue, out))
            for loop, items in deliveries.items():
                try:
                    loop.call_soon_threadsafe(_deliver, items)
                except RuntimeError:  # the event loop is closed: nobody is listening any more
                    pass
        # shutting down: abort what is left so no client waits forever
        self._fail_all(EngineDeadError("the server is shutting down"))

    def _fail_all(self, exc: BaseException) -> None:
        ids = list(self._streams)
        try:
            self.engine.abort_request(ids)
        except Exception:
            logger.exception("abort after failure failed")
        for rid in ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.put(exc)

    def _submit(self, fn: Callable[[], Any], done=None) -> None:
        with self._cv:
            if self._stop:
                raise EngineDeadError("the engine is shut down")
            self._commands.append((fn, done))
            self._cv.notify()

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps and return its result."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def done(result, exc):
            def settle():
                if fut.done():
                    return
                if exc is not None:
                    fut.set_exception(exc)
                else:
                    fut.set_result(result)

            loop.call_soon_threadsafe(settle)

        self._submit(lambda: fn(self.engine), done)
        return await fut

    # -- event loop side --------------------------------------------------------------------
    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        prompt: str | None = None,
        cache_salt: str | None = None,
        lora_request: Any = None,
        hidden_states_from: int | None = None,
        priority: int = 0,
        mm_items: tuple[MultiModalItem, ...] = (),
        cache_priority: int | None = None,
        thinks: bool | None = None,
    ) -> AsyncIterator[RequestOutput]:
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        stream = _Stream(asyncio.Queue(), loop)
        arrival = time.time()
        added = loop.create_future()

        # admitted here, off the engine loop: a bad request fails before anything is queued
        req = self.input_processor.admit(
            prompt_token_ids,
            params,
            prompt_text=prompt,
            lora_request=lora_request,
            cache_salt=cache_salt,
            priority=priority,
            mm_items=mm_items,
            hidden_states_from=hidden_states_from,
            cache_priority=cache_priority,
            thinks=thinks,
        )

        def add() -> None:
            self.engine.add_processed(req, request_id=request_id, arrival_time=arrival)
            self._streams[request_id] = stream

        def done(_result, exc):
            loop.call_soon_threadsafe(
                lambda: added.done() or (added.set_exception(exc) if exc is not None else added.set_result(None))
            )

        self._submit(add, done)
        try:
            await added  # ValueError from the engine surfaces here, before anything was queued
        except ValueError:
            raise
        except BaseException:  # cancelled while the add was in flight: make sure it goes away
            self.abort(request_id)
            raise
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    stream.finished = True
                    return
        finally:
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        def do() -> None:
            if self._streams.pop(request_id, None) is not None and self.on_aborted is not None:
                self.on_aborted()
            self.engine.abort_request(request_id)

        try:
            self._submit(do)
        except EngineDeadError:
            pass

    async def reset_prefix_cache(self) -> bool:
        return await self.call(lambda e: e.reset_prefix_cache())
