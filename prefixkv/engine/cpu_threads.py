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
processes keep k of its CPUs busy; every step on a quiet machine on the configured count.
Neighbours the scheduler weighs below us (niced, in our scheduling group) are no competition: their
time is left out (`ForeignLoad`).

A step of many tokens (a prefill) beside a neighbour cannot be decided from the load alone: beside
one keeping 70% of a core busy two threads prefill 5-10% faster than one, beside one keeping a
whole core busy 1.2-1.7x slower (docs/benchmarks.md, two sessions), and /proc/stat shows the two
neighbours alike (0.78 and 0.83 cores while our threads compete). So such a step decides from
its own layers (`LayerProbe`): its first layers are timed on the configured count, the next ones
on the cores left, and the rest run on the faster - the layers of a step are the same work, so
their times compare directly. Where the earlier probes' times are decisive, most long steps skip
the probe and run on the faster count throughout (one in PROBE_SKIPS + 1 still probes).
While a neighbour keeps one of our cores busy, a long step also splits its products by rows handed
out to threads as they come free (model/row_split.py), where oneDNN would split them statically and
run at the pace of the thread on the shared core: beside a 70% neighbour a 761-token prefill took
0.79 s split vs 0.90 s whole in bfloat16, 1.35 vs 1.58 s in float32 (bench/prefill_threads.py,
docs/benchmarks.md). The probe then weighs the configured count, split, against the cores left.
Outputs do not depend on the count nor on the split: every kernel of prefixkv's splits its work by
the data or by the CPUs it may use, never by the threads of the call, and a split product's rows
are the whole product's bits (tests/engine/test_cpu_threads.py checks logprobs bit for bit). The
libraries' kernels need not: on the 16-core Intel Xeon of a lent GPU machine (AMX) bfloat16
logprobs differed between 1 and 16 threads (2026-11-26). So the engine first checks, once per
machine for a model shape, dtype and count (the answer kept on disk), that a long prompt and a
decode step give the same bits at the counts the policy may pick (`thread_counts_agree`), and
keeps the count fixed where not.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..model import row_split
from ..model.kernels import build

if TYPE_CHECKING:
    from ..model import LlamaModel

WINDOW_S = 0.25  # foreign load is averaged over this long; shorter windows read /proc/stat's ticks too coarsely
CONTENDED_CORE = 0.25  # foreign load (in cores) from which one core counts as taken
HEAVY_STEP_TOKENS = 128  # a step of at least this many tokens is long matrix products: probed by layers
PROBE_LAYERS = 4  # layers timed on each count by a long step beside a neighbour (after one untimed)
# A layer's time beside a neighbour is heavy-tailed (two threads stall for a scheduler slice now
# and then), so a choice weighs the earlier probes' times too, each probe's at PROBE_DECAY of the
# next one's, and forgets them after PROBE_MEMORY_S without a probe (the neighbour may be gone).
PROBE_DECAY = 0.75
PROBE_MEMORY_S = 5.0
# A probe costs its layers on the slower count (beside a 70% neighbour ~8% of a prefill: 0.855 s
# against 0.790 split throughout, docs/benchmarks.md). Where the evidence is decisive - one count's
# timed layers at least PROBE_SKIP_MARGIN times the other's - up to PROBE_SKIPS long steps in a row
# run wholly on the faster count unprobed; then one probes again, so a changed neighbour is seen.
PROBE_SKIP_MARGIN = 1.2
PROBE_SKIPS = 3
_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_ticks(cpus: frozenset[int]) -> tuple[int, int] | None:
    """(busy, nice) time of the given CPUs since boot, in clock ticks, from /proc/stat: busy is
    every column but idle and iowait (steal included: time the hypervisor gave our virtual CPU to
    someone else is taken from us too); nice is the user time of processes above nice 0. None
    where /proc/stat cannot be read."""
    try:
        with open("/proc/stat", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    busy = nice = 0
    for line in lines[1:]:
        if not line.startswith(b"cpu"):
            break  # the per-CPU lines come first
        name, *fields = line.split()
        if int(name[3:]) not in cpus:
            continue
        # user nice system idle iowait irq softirq steal [guest guest_nice: already in user/nice]
        ticks = [int(x) for x in fields[:8]]
        busy += sum(ticks) - ticks[3] - ticks[4]
        nice += ticks[1]
    return busy, nice


# Niced time below this share of a core in a window is not worth reading every process for.
NICE_SCAN_CORES = 0.1


def _sched_group(pid: int | str) -> str | None:
    """The scheduling group a process's nice counts within: its CPU cgroup and, where the kernel
    groups by session (autogroup, the default of most desktop kernels, for processes in the root
    cgroup), its autogroup. None where /proc does not say (the process is gone)."""
    try:
        with open(f"/proc/{pid}/cgroup", "rb") as f:
            cgroups = f.read()
    except OSError:
        return None
    group = b"/"
    for line in cgroups.splitlines():
        _, controllers, path = line.split(b":", 2)
        if b"cpu" in controllers.split(b",") or (controllers == b"" and group == b"/"):
            group = path
    try:
        with open(f"/proc/{pid}/autogroup", "rb") as f:
            autogroup = f.read().split()[0]
    except (OSError, IndexError):
        autogroup = b""
    return (group + b" " + autogroup).decode(errors="replace")


def _lower_priority_ticks(own_nice: int, own_group: str | None) -> dict[int, int]:
    """Per process that the scheduler weighs below this one - above our nice, in our scheduling
    group - its user + system time since it started, in clock ticks (/proc/<pid>/stat)."""
    me = os.getpid()
    ticks: dict[int, int] = {}
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return ticks
    for pid in pids:
        if pid == me:
            continue
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # fields[0] is the state (field 3 of proc(5)): utime 14, stime 15, nice 19
        if int(fields[16]) > own_nice and _sched_group(pid) == own_group:
            ticks[pid] = int(fields[11]) + int(fields[12])
    return ticks


def _own_nice() -> int:
    try:
        return os.getpriority(os.PRIO_PROCESS, 0)
    except (AttributeError, OSError):  # no priorities here
        return 0


@dataclass
class ForeignLoad:
    """Cores' worth of CPU that other processes used on our CPUs over the last window.

    Processes the scheduler weighs far below ours - niced above our nice, in our scheduling group -
    run on what our threads leave: they are no competition, and their time is left out (beside
    nice-19 busy loops the policy used to drop threads while the cores were in fact ours: a
    478-token prefill 8,986 ms where vLLM beside the same neighbours took 2,750). /proc/stat's
    "nice" column does not say whose niced time it is, and a niced process of another session
    (autogroup) or cgroup competes like any other - the kernel weighs the groups, then the nice
    within each: measured on the shared 2-vCPU VM, other sessions' nice-19 jobs cost a 16-token
    generate 0.4 -> 1-8 s when their time was left out. So where the window shows niced time
    (`NICE_SCAN_CORES` or more) the processes are read (/proc/<pid>/stat) and only the time of
    those in our group is left out. Every niced level above ours counts as lower (nice 1 against
    0 is weight 820 against 1024: close to a peer, but niced work is background work by convention)."""

    cpus: frozenset[int]
    cores: float = 0.0
    nice: int | None = None  # the nice our threads run at: this process's (tests pass another)
    _at: float = 0.0
    _ticks: tuple[int, int] | None = None
    _own: float = 0.0
    _lower: dict[int, int] | None = None  # lower-priority processes' ticks at the window's start

    def __post_init__(self) -> None:
        self._nice = _own_nice() if self.nice is None else self.nice
        self.group = _sched_group("self")
        self._at, self._ticks, self._own = time.monotonic(), _cpu_ticks(self.cpus), time.process_time()
        self._lower = _lower_priority_ticks(self._nice, self.group)

    @property
    def available(self) -> bool:
        return self._ticks is not None

    def update(self, now: float) -> None:
        """Close the window, and set `cores` from it, if it is long enough."""
        if now - self._at < WINDOW_S or self._ticks is None:
            return
        ticks, own = _cpu_ticks(self.cpus), time.process_time()
        if ticks is None:
            return
        seconds = now - self._at
        busy, nice = ((b - a) / _TICKS_PER_S for a, b in zip(self._ticks, ticks))
        foreign = busy - (own - self._own)
        niced = nice >= NICE_SCAN_CORES * seconds
        if niced or self._lower is not None:
            lower = _lower_priority_ticks(self._nice, self.group)
            if self._lower is not None:  # (without the window's start, its niced time counts this once)
                spent = sum(t - self._lower.get(pid, 0) for pid, t in lower.items()) / _TICKS_PER_S
                # at most what the window shows (their time may have run on CPUs not ours)
                foreign -= min(spent, max(0.0, foreign))
            # kept as the next window's start while niced time shows; else the next scan waits for it
            self._lower = lower if niced else None
        self.cores = max(0.0, foreign / seconds)
        self._at, self._ticks, self._own = now, ticks, own


def threads_left(configured: int, cpus: int, foreign_cores: float) -> int:
    """The thread count that fits the cores other processes leave us: `cpus` CPUs, `foreign_cores`
    of which are kept busy. Fewer than configured only when the cores left are fewer (4 threads on
    16 CPUs beside 12 busy ones keep their 4)."""
    taken = int(foreign_cores + (1 - CONTENDED_CORE))  # 0.25 -> 1, 1.25 -> 2 ...
    if taken == 0:
        return configured
    return max(1, min(configured, cpus - taken))


def threads_for(configured: int, cpus: int, foreign_cores: float, step_tokens: int) -> int:
    """The thread count a step of `step_tokens` tokens starts on: the cores left for a short step,
    the configured count for a long one (which may then move to the cores left, `LayerProbe`)."""
    if step_tokens >= HEAVY_STEP_TOKENS:
        return configured
    return threads_left(configured, cpus, foreign_cores)


class LayerProbe:
    """One long step's choice between two thread counts, made from the times of its own layers:
    layer 0 runs untimed on `first` (it may pay for the previous step's count), the next
    `layers_each` are timed on `first`, the next `layers_each` on `second` (their time includes
    the switch), and every later layer runs on the count whose layers took less time. In blocks,
    not alternating layer by layer: a thread that sleeps through every other layer is woken ahead
    of the neighbour by the kernel's scheduler, and two threads alternating with one measured
    faster than one where, run as a block, they were 1.2-1.3x slower. `at_layer` is called at the
    start of each layer with the time; it returns the count to set, or None to keep the current one."""

    def __init__(
        self, first: int, second: int, layers_each: int = PROBE_LAYERS, prior: tuple[float, float] = (0.0, 0.0)
    ) -> None:
        self.counts = (first, second)
        self.switch_at = 1 + layers_each
        self.decide_at = self.decision_layer(layers_each)
        self.spent = [0.0, 0.0]  # seconds of the timed layers on each count
        self.prior = prior  # earlier probes' (decayed) seconds on each count, weighed in the choice
        self.chosen: int | None = None
        self._block_start = 0.0

    @staticmethod
    def decision_layer(layers_each: int) -> int:
        """The layer whose start ends the last timed one: where the probe decides."""
        return 1 + 2 * layers_each

    def at_layer(self, index: int, now: float) -> int | None:
        if index == 1:
            self._block_start = now
        elif index == self.switch_at:
            self.spent[0], self._block_start = now - self._block_start, now
            return self.counts[1]
        elif index == self.decide_at:
            self.spent[1] = now - self._block_start
            first, second = self.prior[0] + self.spent[0], self.prior[1] + self.spent[1]
            self.chosen = self.counts[1] if second < first else self.counts[0]
            return self.chosen
        return None


class AdaptiveCpuThreads:
    """Sets torch's thread count before each CPU step, and within a long step beside a neighbour
    between its layers (see the module's docstring). The engine calls `before_step` from the
    thread that runs the model: OpenMP's count is per thread."""

    def __init__(self, configured: int | None = None) -> None:
        self.configured = configured or torch.get_num_threads()
        self.load = ForeignLoad(frozenset(os.sched_getaffinity(0)))
        self.threads = self.configured
        self.steps_adapted = 0  # steps that ran (most of their layers) on another count than the configured one
        self.steps_probed = 0  # long steps beside a neighbour that timed their layers on two counts
        self.steps_row_split = 0  # long steps beside a neighbour whose products were split by rows
        # built here, at start-up (once per machine), not by the first step beside a neighbour
        self.can_split = row_split.available()
        self.layers: Sequence[nn.Module] = ()
        self.layers_each = PROBE_LAYERS  # a probe's timed layers on each count
        self.probe: LayerProbe | None = None
        self._hooks: list[RemovableHandle] = []
        # earlier probes' decayed seconds on each count, for which counts, and when last
        self._evidence = (0.0, 0.0)
        self._evidence_counts = (0, 0)
        self._evidence_at = 0.0
        self._skipped = 0  # long steps in a row that ran unprobed on decisive evidence

    @property
    def available(self) -> bool:
        return self.load.available

    def watch_layers(self, layers: Sequence[nn.Module]) -> None:
        """The model's decoder layers, called in order by each step's forward: a long step beside
        a neighbour times them to choose its count. Without them long steps keep the configured one."""
        self.layers = layers

    def before_step(self, step_tokens: int) -> int:
        self._end_probe()
        self.load.update(time.monotonic())
        threads = threads_for(self.configured, len(self.load.cpus), self.load.cores, step_tokens)
        self._set(threads)
        split = False
        if threads != self.configured:
            self.steps_adapted += 1
        elif step_tokens >= HEAVY_STEP_TOKENS:
            left = threads_left(self.configured, len(self.load.cpus), self.load.cores)
            if left != threads:
                self._start_probe(threads, left)
                split = self.can_split and self.threads > 1
        self._split(split)
        return self.threads

    def restore(self) -> None:
        """Back to the configured count and whole products (the engine is idle)."""
        self._end_probe()
        self._set(self.configured)
        self._split(False)

    def _split(self, on: bool) -> None:
        if on:
            self.steps_row_split += 1
        row_split.set_active(on)

    def _set(self, threads: int) -> None:
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads

    def _start_probe(self, first: int, second: int) -> None:
        """Time this long step's layers on `first` and `second` - or, on decisive evidence from the
        earlier probes, run it on the faster count unprobed (at most PROBE_SKIPS steps in a row)."""
        if len(self.layers) <= LayerProbe.decision_layer(self.layers_each) + 1:  # too few left to run on the faster
            return
        now = time.monotonic()
        if self._evidence_counts != (first, second) or now - self._evidence_at > PROBE_MEMORY_S:
            self._evidence, self._evidence_counts = (0.0, 0.0), (first, second)
        prior = (self._evidence[0] * PROBE_DECAY, self._evidence[1] * PROBE_DECAY)
        if self._skipped < PROBE_SKIPS and min(prior) > 0 and max(prior) >= PROBE_SKIP_MARGIN * min(prior):
            self._skipped += 1
            faster = first if prior[0] < prior[1] else second
            self._set(faster)
            if faster != self.configured:
                self.steps_adapted += 1
            return
        self._skipped = 0
        self._evidence_at = now
        probe = self.probe = LayerProbe(first, second, self.layers_each, prior)
        self.steps_probed += 1
        for index in (1, probe.switch_at, probe.decide_at):
            self._hooks.append(self.layers[index].register_forward_pre_hook(self._layer_hook(index)))

    def _layer_hook(self, index: int) -> Callable[[nn.Module, object], None]:
        def hook(module: nn.Module, args: object) -> None:
            probe = self.probe
            if probe is None:
                return
            threads = probe.at_layer(index, time.perf_counter())
            if threads is not None:
                self._set(threads)
            if probe.chosen is not None:
                if probe.chosen != self.configured:
                    self.steps_adapted += 1
                self._evidence = (probe.prior[0] + probe.spent[0], probe.prior[1] + probe.spent[1])
                self._end_probe()

        return hook

    def _end_probe(self) -> None:
        """Drop the probe's hooks (a step that failed mid-forward may leave them)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.probe = None


# A long step (>= HEAVY_STEP_TOKENS: many-row products) whose decode step after it reads 400+ keys
# (few-row products, the decode kernel's split by keys): the length that showed the Intel Xeon's
# bfloat16 differences on the GPU machine (2026-11-26). 1.7 s float32 / 0.9 s bfloat16 on CI's 2
# cores, so the answer is kept on disk, once per machine (see `thread_counts_agree`).
CHECK_PROMPT_TOKENS = 448
_AGREEMENT: dict[str, bool] = {}  # this process's answers, by `_agreement_key`


def thread_counts_agree(model: LlamaModel, configured: int) -> bool:
    """Whether `model` (on the CPU, laid out as the engine runs it) computes the same bits on 1,
    configured - 1 and `configured` threads: a prompt of CHECK_PROMPT_TOKENS random tokens, then one
    decode step. Measured once per machine for a model shape, dtype and count: the answer is kept
    beside the native kernels' builds, under a key of everything it depends on - the CPU, torch,
    prefixkv's model code and kernels - so a change to any of them measures again."""
    key = _agreement_key(model, configured)
    if key in _AGREEMENT:
        return _AGREEMENT[key]
    stored = _agreement_file(key)
    try:
        agree = json.loads(stored.read_text())["agree"]
    except (OSError, ValueError, KeyError, TypeError):
        agree = _measure_agreement(model, configured)
        try:
            stored.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".check-", dir=stored.parent)
            with os.fdopen(fd, "w") as f:
                json.dump({"agree": agree, "threads": configured, "dtype": str(model.dtype)}, f)
            os.replace(tmp, stored)  # atomic: a concurrent process reads the whole answer or none
        except OSError:  # a read-only cache: measured again next time
            pass
    _AGREEMENT[key] = bool(agree)
    return bool(agree)


def agreement_counts(configured: int) -> list[int]:
    """The thread counts whose outputs must agree: every count the adaptive policy may drop to from
    `configured` (it never raises it) - 1 and configured - 1 - and the configured one."""
    return sorted({1, max(1, configured - 1), configured})


def _agreement_key(model: LlamaModel, configured: int) -> str:
    key = hashlib.sha256()
    for part in (repr(model.config), str(model.dtype), str(configured), torch.__version__, _cpu_identity()):
        key.update(part.encode() + b"\0")
    model_code = Path(__file__).resolve().parent.parent / "model"
    for path in sorted(model_code.rglob("*")):
        if path.suffix in (".py", ".cpp", ".h"):
            key.update(path.read_bytes())
    return key.hexdigest()[:24]


def _cpu_identity() -> str:
    """The CPU's model name and flags (/proc/cpuinfo), or the platform's name where there is none."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    # an emulated CPU (PREFIXKV_EMULATE_CPU) runs other code: keyed apart
    identity = "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))
    emulation = build.emulated()
    return identity + f"\nemulating {emulation}" if emulation else identity


def _agreement_file(key: str) -> Path:
    return build.cache_dir().parent / "thread-agreement" / f"{key}.json"


def _measure_agreement(model: LlamaModel, configured: int) -> bool:
    from ..memory.block_tensors import allocate_kv_cache
    from ..model import AttentionMetadata

    config = model.config
    counts = agreement_counts(configured)
    block = 16
    n = CHECK_PROMPT_TOKENS
    blocks = (n + 1 + block - 1) // block
    table = torch.arange(blocks)[None]
    ids = torch.randint(0, config.vocab_size, (n + 1,), generator=torch.Generator().manual_seed(0))
    prefill = AttentionMetadata(torch.arange(n), [0, n], [n], table)
    decode = AttentionMetadata(torch.tensor([n]), [0, 1], [n + 1], table)
    before = torch.get_num_threads()
    results = []
    try:
        for count in counts:
            torch.set_num_threads(count)
            caches = allocate_kv_cache(config, blocks, block, dtype=model.dtype, device="cpu")
            with torch.inference_mode():
                first = model.compute_logits(model(ids[:n], torch.arange(n), caches, prefill)[-1:])
                second = model.compute_logits(model(ids[n:], torch.tensor([n]), caches, decode))
            results.append((first, second))
    finally:
        torch.set_num_threads(before)
    return all(torch.equal(a, results[0][0]) and torch.equal(b, results[0][1]) for a, b in results[1:])
