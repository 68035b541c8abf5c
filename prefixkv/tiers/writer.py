"""A background writer per slow tier: the engine hands it whole values and never waits on the
store. Its queue is bounded in bytes; when it is full (the store is slower than the engine
produces blocks) new values are dropped and counted, never buffered without bound."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

DEFAULT_MAX_PENDING_BYTES = 256 << 20


class BackgroundWriter:
    def __init__(
        self,
        name: str,
        put: Callable[[bytes, bytes], None],
        on_done: Callable[[bytes, int, float, BaseException | None, Any], None],
        may_write: Callable[[], bool],
        on_drop: Callable[[], None],
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
    ) -> None:
        self._put = put
        self._on_done = on_done  # (key, nbytes, seconds, error or None, tag), from the writer thread
        self._may_write = may_write  # False while the tier is down: queued values are dropped
        self._on_drop = on_drop
        self.max_pending_bytes = max_pending_bytes
        self.pending_bytes = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[bytes, bytes, Any] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"prefixkv-kv-tier-{name}", daemon=True)
        self._thread.start()

    def submit(self, key: bytes, value: bytes, tag: Any = None) -> bool:
        """Queue a value (`tag` is handed back to on_done); False (not queued) when the queue is full."""
        with self._lock:
            if self.pending_bytes + len(value) > self.max_pending_bytes:
                return False
            self.pending_bytes += len(value)
        self._queue.put((key, value, tag))
        return True

    def _run(self) -> None:
        import time

        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            key, value, tag = item
            try:
                if not self._may_write():
                    self._on_drop()
                    continue
                t0 = time.perf_counter()
                try:
                    self._put(key, value)
                except Exception as e:  # noqa: BLE001 (a failing store is reported, the engine goes on)
                    self._on_done(key, len(value), time.perf_counter() - t0, e, tag)
                else:
                    self._on_done(key, len(value), time.perf_counter() - t0, None, tag)
            finally:
                with self._lock:
                    self.pending_bytes -= len(value)
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued value is written (or dropped)."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
