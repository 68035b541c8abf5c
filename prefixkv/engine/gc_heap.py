"""The engine's long-lived objects kept out of Python's full garbage collections (vLLM freezes its
start-up heap the same way).

A built engine holds hundreds of thousands of objects that live as long as it does - one
`KVCacheBlock` per block of the cache (131,072 for a small model's default cache), the modules
imported on the way. Python's oldest-generation collection walks all of them: a pause of 139-165 ms
of every request in flight, once every 40 decode steps at batch 256 with logprobs=5 (a tiny model,
2-vCPU AMD EPYC Zen 4; logprob entries are what survives into the old generation). Frozen, those
objects are skipped: the longest collection in the same runs took 10-18 ms, and 1-2 ms at batch 64.

What a step allocates is short-lived but not short enough for the youngest generation's default
threshold (700 container objects): at batch 256 a step's scheduled requests and their lists, with
async scheduling two steps' worth, pass it each step, so each step paid a young collection that
moved them to the middle generation (0.33-0.40 ms), and one step in ten a middle one (1.3-1.8 ms)
- about 2 us a request a step, with nothing to free (`bench/host_overhead.py --gpu-path`, a tiny
model, 2-vCPU AMD EPYC Zen 3). After the freeze the youngest threshold is raised to
YOUNG_THRESHOLD: no collection ran during those steps then. Reference counting frees what a step
made (the collections before freed nothing: no cycle is made per step); a rare cycle waits longer.

A frozen object is never collected, so an engine's build thaws the heap first: an engine built and
dropped earlier in the process (its objects form cycles: only the collector frees them) is
collected with the new one's freeze, not kept for good. That collection walks the whole heap:
~0.2 s a build in a bare process, ~0.5 s in a test worker holding reference models.
`PREFIXKV_FREEZE_GC=0` leaves the collector as Python sets it, for a process that builds engine
after engine (the test suite: 185 builds in three of its folders spent 90 s in it), its thresholds too."""

from __future__ import annotations

import gc
import logging
import os
import time

logger = logging.getLogger("prefixkv")

ENV_SWITCH = "PREFIXKV_FREEZE_GC"
YOUNG_THRESHOLD = 50_000  # the youngest generation's, after a build (Python's default: 700)


def enabled() -> bool:
    """`PREFIXKV_FREEZE_GC`: 1 (the default) or 0; anything else is refused by name."""
    value = os.environ.get(ENV_SWITCH, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{ENV_SWITCH}={value!r}: expected 0 or 1")
    return value == "1"


def thaw_long_lived_objects() -> None:
    """Objects frozen before (an earlier engine's) go back to the collector: before a build."""
    if enabled():
        gc.unfreeze()


def freeze_long_lived_objects() -> None:
    """Collect what is garbage now, then move every object still alive to the permanent
    generation (gc.freeze), and raise the youngest generation's threshold to YOUNG_THRESHOLD
    (never lowered): after a build, which thawed the heap first."""
    if not enabled():
        return
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    young, middle, old = gc.get_threshold()
    if young < YOUNG_THRESHOLD:
        gc.set_threshold(YOUNG_THRESHOLD, middle, old)
    logger.debug(
        "%d long-lived objects kept out of garbage collection (%.0f ms)",
        gc.get_freeze_count(),
        (time.perf_counter() - start) * 1e3,
    )
