"""Loader threads for the asynchronous tiers' lookups, which never hold up the process's exit."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class DaemonPool:
    """Loader threads that never hold up the process's exit. ThreadPoolExecutor's workers are
    joined at interpreter exit, so one read that never returns (a hung network mount) kept a
    SIGTERMed server alive forever; these are daemon threads, and `shutdown` only cancels the
    loads not started. A load already running is abandoned (its request was given up on at the
    load deadline)."""

    def __init__(self, num_threads: int, name: str) -> None:
        self._num_threads = num_threads
        self._name = name
        self._threads: list[threading.Thread] = []
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the tier loader is shut down")
            if len(self._threads) < self._num_threads:  # started as needed, as the executor did
                t = threading.Thread(target=self._run, name=f"{self._name}_{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
            self._jobs.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as e:  # noqa: BLE001 (handed to whoever takes the result)
                future.set_exception(e)
            else:
                future.set_result(result)

    def shutdown(self) -> None:
        """Cancel the loads not started and let the threads end; never waits for them."""
        with self._lock:
            self._closed = True
            threads = len(self._threads)
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        for _ in range(threads):
            self._jobs.put(None)
