"""How many threads a CPU step runs on, given what other processes take from our cores.

A parallel region waits for its slowest thread, and the split of work into threads is static
(oneDNN's GEMMs, most of the native kernels): when another process shares one of our cores, the
thread on it gets about half of it and every region runs at that thread's pace, plus the wake-ups
and barriers of ~300 short regions a decode step. Measured on 2 cores beside a neighbour keeping
70% of one busy (docs/benchmarks.md, "Adaptive threads"), decoding one sequence in one process,
the counts alternating: 33.3 ms a token on two threads, 22.4 on one (quiet: 16.8 and 20.6). A
761-token prefill gains nothing from fewer threads (0.96 s on two, 1.06 on one) nor from more
(0.94 on four, 0.94 on three: a thread that finishes sleeps and the idle core may pull a waiting
one over, but not reliably).

So `AdaptiveCpuThreads` measures the foreign load - CPU time that other processes took on the
CPUs this process may use, from /proc/stat less this process's own CPU time - over windows of a
quarter second, and sets torch's thread count before each step: a step of few tokens (decode)
runs on the cores left to it (at least one thread, at most the configured count) while other
processes keep k of its CPUs busy; a step
of many tokens, and every step on a quiet machine, on the configured count.
Outputs do not depend on the count: every kernel splits its work by the data or by the CPUs it may
use, never by the threads of the call (tests/engine/test_cpu_threads.py checks logprobs bit for bit).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

WINDOW_S = 0.25  # foreign load is averaged over this long; shorter windows read /proc/stat's ticks too coarsely
CONTENDED_CORE = 0.25  # foreign load (in cores) from which one core counts as taken
HEAVY_STEP_TOKENS = 128  # a step of at least this many tokens is long matrix products: all threads
_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _busy_ticks(cpus: frozenset[int]) -> int | None:
    """Non-idle time of the given CPUs since boot, in clock ticks (steal included: time the
    hypervisor gave our virtual CPU to someone else is taken from us too). None where /proc/stat
    cannot be read."""
    try:
        with open("/proc/stat", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    busy = 0
    for line in lines[1:]:
        if not line.startswith(b"cpu"):
            break  # the per-CPU lines come first
        name, *fields = line.split()
        if int(name[3:]) not in cpus:
            continue
        # user nice system idle iowait irq softirq steal [guest guest_nice: already in user/nice]
        ticks = [int(x) for x in fields[:8]]
        busy += sum(ticks) - ticks[3] - ticks[4]
    return busy


@dataclass
class ForeignLoad:
    """Cores' worth of CPU that other processes used on our CPUs over the last window."""

    cpus: frozenset[int]
    cores: float = 0.0
    _at: float = 0.0
    _busy: int | None = None
    _own: float = 0.0

    def __post_init__(self) -> None:
        self._at, self._busy, self._own = time.monotonic(), _busy_ticks(self.cpus), time.process_time()

    @property
    def available(self) -> bool:
        return self._busy is not None

    def update(self, now: float) -> None:
        """Close the window, and set `cores` from it, if it is long enough."""
        if now - self._at < WINDOW_S or self._busy is None:
            return
        busy, own = _busy_ticks(self.cpus), time.process_time()
        if busy is None:
            return
        foreign = (busy - self._busy) / _TICKS_PER_S - (own - self._own)
        self.cores = max(0.0, foreign / (now - self._at))
        self._at, self._busy, self._own = now, busy, own


def threads_for(configured: int, cpus: int, foreign_cores: float, step_tokens: int) -> int:
    """The thread count for a step of `step_tokens` tokens on `cpus` CPUs, `foreign_cores` of
    which other processes keep busy. Fewer threads only when the cores left to us are fewer than
    the configured count (4 threads on 16 CPUs beside 12 busy ones keep their 4)."""
    taken = int(foreign_cores + (1 - CONTENDED_CORE))  # 0.25 -> 1, 1.25 -> 2 ...
    if taken == 0 or step_tokens >= HEAVY_STEP_TOKENS:
        return configured
    return max(1, min(configured, cpus - taken))


class AdaptiveCpuThreads:
    """Sets torch's thread count before each CPU step (see the module's docstring). The engine
    calls `before_step` from the thread that runs the model: OpenMP's count is per thread."""

    def __init__(self, configured: int | None = None) -> None:
        self.configured = configured or torch.get_num_threads()
        self.load = ForeignLoad(frozenset(os.sched_getaffinity(0)))
        self.threads = self.configured
        self.steps_adapted = 0  # steps that ran on another count than the configured one

    @property
    def available(self) -> bool:
        return self.load.available

    def before_step(self, step_tokens: int) -> int:
        self.load.update(time.monotonic())
        threads = threads_for(self.configured, len(self.load.cpus), self.load.cores, step_tokens)
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
        if threads != self.configured:
            self.steps_adapted += 1
        return threads

    def restore(self) -> None:
        """Back to the configured count (the engine is idle)."""
        if self.threads != self.configured:
            torch.set_num_threads(self.configured)
            self.threads = self.configured
