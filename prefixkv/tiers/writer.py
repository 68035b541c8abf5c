"""A background writer per slow tier: the engine hands it whole values and never waits on the
store. Its queue is bounded in bytes; when it is full (the store is slower than the engine
produces blocks) new values are dropped and counted, never buffered without bound.

The writer thread is a daemon (an engine never has to close its tiers), so at interpreter exit
the queued values are written first (for at most EXIT_FLUSH_S per writer): a script that
generates and returns would otherwise lose the blocks of its last steps, which a slow store
has not written yet, and the next run would find the prefix only partly stored."""

from __future__ import annotations

import atexit
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

DEFAULT_MAX_PENDING_BYTES = 256 << 20
EXIT_FLUSH_S = 10.0  # a hung store delays the exit this long at most

logger = logging.getLogger("prefixkv")
_open_writers: set[BackgroundWriter] = set()  # flushed at interpreter exit (daemon threads still run then)
_open_lock = threading.Lock()


@atexit.register
def _flush_at_exit() -> None:
    with _open_lock:
        writers = list(_open_writers)
    for writer in writers:
        if not writer.flush(EXIT_FLUSH_S):
            logger.warning(
                "KV tier writer %s: %d value(s) still queued after %g s at exit; not stored",
                writer.name,
                writer.pending,
                EXIT_FLUSH_S,
            )


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
        self.name = name
        self._put = put
        self._on_done = on_done  # (key, nbytes, seconds, error or None, tag), from the writer thread
        self._may_write = may_write  # False while the tier is down: queued values are dropped
        self._on_drop = on_drop
        self.max_pending_bytes = max_pending_bytes
        self.pending_bytes = 0
        self.pending = 0  # values queued or being written
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when `pending` drops to 0
        self._queue: queue.Queue[tuple[bytes, bytes, Any] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"prefixkv-kv-tier-{name}", daemon=True)
        self._thread.start()
        with _open_lock:
            _open_writers.add(self)

    def submit(self, key: bytes, value: bytes, tag: Any = None) -> bool:
        """Queue a value (`tag` is handed back to on_done); False (not queued) when the queue is full."""
        with self._lock:
            if self.pending_bytes + len(value) > self.max_pending_bytes:
                return False
            self.pending_bytes += len(value)
            self.pending += 1
        self._queue.put((key, value, tag))
        return True

    def _run(self) -> None:
        import time

        while True:
            item = self._queue.get()
            if item is None:
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
                    self.pending -= 1
                    if not self.pending:
                        self._idle.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued value is written (or dropped); False if `timeout` ran out first."""
        with self._idle:
            return self._idle.wait_for(lambda: not self.pending, timeout)

    def close(self) -> None:
        with _open_lock:
            _open_writers.discard(self)
        self._queue.put(None)
        self._thread.join(timeout=5)
