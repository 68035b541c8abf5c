"""Start-up stages that say what they do: nothing is silent for more than `SILENT_S` seconds.

A stage that is usually quick (loading the kernels, laying the weights out) but can be slow (the
first start on a machine builds the kernels; a loaded machine) announces itself only once it has
run for `SILENT_S`: a timer logs "<what>..." then, and the stage's end logs its time. Stages known
in advance to be long (a first dequantization) log before they start, where they run. `Stages`
keeps each stage's time for the one summary line an engine logs when it is ready.

The lines go to the "prefixkv" logger at INFO: `prefixkv serve`, `generate`, `chat` and the demo
show them on stderr (`show_info_logs`); a program using `LLM()` sees them once it configures logging
(``logging.basicConfig(level=logging.INFO)``).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator

SILENT_S = 2.0

logger = logging.getLogger("prefixkv")


@contextlib.contextmanager
def announced(what: str, log: logging.Logger = logger, after: float = SILENT_S) -> Iterator[None]:
    """Run the block; if it takes `after` seconds or more, log "<what>..." at that moment and
    "<what>: done in N s" at its end."""
    timer = threading.Timer(after, log.info, args=("%s...", what))
    timer.daemon = True
    start = time.perf_counter()
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        elapsed = time.perf_counter() - start
        if elapsed >= after:
            log.info("%s: done in %.1f s", what, elapsed)


class Stages:
    """The times of a start's stages, each `announced` when slow, for one summary line."""

    def __init__(self, log: logging.Logger = logger) -> None:
        self.log = log
        self.times: dict[str, float] = {}
        self._start = time.perf_counter()

    @contextlib.contextmanager
    def stage(self, name: str, what: str) -> Iterator[None]:
        """Time the block as `name` (summed if run again); `what` says what it does when it is slow."""
        start = time.perf_counter()
        with announced(what, self.log):
            yield
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start

    def total(self) -> float:
        return time.perf_counter() - self._start

    def summary(self) -> str:
        """ "4.2 s (model 0.8 s, KV cache 1.5 s, ...)": the whole and each stage of 0.05 s or more."""
        parts = ", ".join(f"{name} {t:.1f} s" for name, t in self.times.items() if t >= 0.05)
        return f"{self.total():.1f} s ({parts})" if parts else f"{self.total():.1f} s"


def show_info_logs() -> None:
    """Show prefixkv's INFO lines on stderr (the terminal commands), unless logging is already
    configured to show them somewhere."""
    root = logging.getLogger()
    if root.handlers or logger.handlers:
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("prefixkv: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
