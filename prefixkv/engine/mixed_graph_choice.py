"""Which mixed steps (prompts and chunks, with or without decodes) replay a CUDA graph: chosen by
timing each captured token count against the eager step on this card, not assumed - and only
where the replay computes what the eager step does.

A replay saves the host launching the step's kernels one by one (on an H200 the default model's
eager decode step took 16.7 ms and its eager 1,024-token prefill 14.3 ms, a replayed decode step
1.04 ms; no mixed step has been timed on a card), but pads the step up to the next captured count
and runs attention over a fixed grid: at the larger counts, where the work itself dominates, the
eager step can be the faster, and where it is depends on the card and the model. So where
compilation_config names no cudagraph_mode, the engine captures the ladder's counts
(cuda_graphs.mixed_capture_sizes), times each count's replay against the eager step of the fewest
tokens that pad up to it (the replay's worst case: the most padding), and replays mixed steps up
to the largest count whose replay was at least as fast there and at every smaller count; the
larger counts' graphs are dropped. The timing stops at the first loss. Each count's replay is
first compared with the eager step on the same input (graph_check.py), and again at every later
start: one that disagrees beyond rounding (a value the capture baked in, a buffer left unwritten,
a kernel only the replay runs computed wrongly on this card) leaves every mixed step eager, with a
warning, and is not kept.

The answer is kept on disk (`kept_answers`), keyed by the card, the torch and Triton versions, the
model's shape and dtype, the block size, the most sequences a step holds, the counts and the
context widths asked for, so it is
measured once per card and model shape, and later starts capture only the counts it kept (and
compare each with the eager step, without timing). One log line says up to where mixed steps
replay and why.

`PREFIXKV_MIXED_GRAPHS=measured|all|none` overrides the policy: `all` replays every captured count
(as cudagraph_mode FULL does), `none` only decode steps (FULL_DECODE_ONLY), `measured` times them
even where cudagraph_mode asks otherwise (how a CPU test runs the timing under Triton's
interpreter). `PREFIXKV_KERNEL_CHOICE=measure` times again where an answer is on disk.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..model.config import ModelConfig
from ..model.kernels import build
from ..model.kernels.kept_answers import answer_path, keep_answer, read_answer
from ..model.weight_cache import dist_version
from .graph_check import compare, synthetic_request
from .scheduler_output import ScheduledRequest

if TYPE_CHECKING:
    from ..progress import Stages
    from .cuda_graphs import StepGraphs
    from .model_runner import ModelRunner

logger = logging.getLogger("prefixkv")

ENV = "PREFIXKV_MIXED_GRAPHS"
POLICIES = ("measured", "all", "none")
# compilation_config cudagraph_mode values that replay every captured count of mixed steps (vLLM's
# FULL and FULL_AND_PIECEWISE; here each step is captured whole: there is no piecewise split)
ALL_MODES = ("FULL", "FULL_AND_PIECEWISE", "PIECEWISE")
FORMAT_VERSION = 1
REPS = 3  # each path's fastest of this many, alternated, after one run each to warm up


def policy(graph_mode: str | None, compilation_config: dict[str, object] | int | None) -> str:
    """ "measured", "all" or "none": how mixed steps replay under graphs of `graph_mode`
    ("capture", "static", None: eager). PREFIXKV_MIXED_GRAPHS first, then compilation_config's
    cudagraph_mode; without either, "measured" where graphs are captured (a GPU) and "none" over
    static buffers (a CPU checking the path asks for mixed steps by name)."""
    asked = os.environ.get(ENV, "").strip().lower()
    if asked and asked not in POLICIES:
        raise ValueError(f"{ENV}={asked!r}: expected one of {', '.join(POLICIES)}")
    if graph_mode is None:
        return "none"
    if asked:
        return asked
    cc = compilation_config if isinstance(compilation_config, dict) else {}
    mode = cc.get("cudagraph_mode")
    if mode is not None:
        return "all" if str(mode).upper() in ALL_MODES else "none"
    return "measured" if graph_mode == "capture" else "none"


@dataclass(frozen=True)
class MixedTiming:
    """One captured count timed: its replay and the eager step of `tokens` (the fewest that pad to it)."""

    size: int
    tokens: int
    eager_ms: float
    replay_ms: float

    def line(self) -> str:
        return (
            f"{self.tokens} tokens: eager {self.eager_ms:.2f} ms, replayed as {self.size} "
            f"{self.replay_ms:.2f} ms ({self.eager_ms / max(self.replay_ms, 1e-9):.2f}x)"
        )


def replay_limit(timings: Sequence[MixedTiming]) -> int:
    """The largest count whose replay was at least as fast as the eager step there and at every
    smaller count (0: none): mixed steps of up to that many tokens replay."""
    limit = 0
    for t in sorted(timings, key=lambda t: t.size):
        if t.replay_ms > t.eager_ms:
            break
        limit = t.size
    return limit


class StoredChoice:
    """The answer for one engine's shapes on this device: read before the capture (its counts are
    the only ones captured), written after a measurement."""

    def __init__(
        self,
        device: torch.device,
        config: ModelConfig,
        dtype: torch.dtype,
        block_size: int,
        max_seqs: int,
        sizes: Sequence[int],
        widths: tuple[int, int | None],
    ) -> None:
        """`widths`: max_seq_len_to_capture and max_model_len as asked (the buffers' width, which a
        timing step's prompts fit, follows from them)."""
        self.device_name = _device_name(device)
        parts = [
            str(FORMAT_VERSION),
            self.device_name,
            torch.__version__,
            dist_version("triton"),
            json.dumps(asdict(config), sort_keys=True, default=str),
            str(dtype),
            str(block_size),
            str(max_seqs),
            ",".join(map(str, sizes)),
            str(widths),
        ]
        self.path: Path = answer_path("mixed-graph-choice", parts)

    def read(self) -> int | None:
        """The replay limit measured before (None: not yet, or PREFIXKV_KERNEL_CHOICE=measure)."""
        if os.environ.get("PREFIXKV_KERNEL_CHOICE", "").strip().lower() == "measure":
            return None
        data = read_answer(self.path)
        limit = data.get("replay_limit") if data is not None else None
        return limit if isinstance(limit, int) and limit >= 0 else None

    def keep(self, limit: int, timings: Sequence[MixedTiming]) -> None:
        keep_answer(
            self.path,
            {
                "replay_limit": limit,
                "device": self.device_name,
                "timings": [asdict(t) for t in timings],
                "lines": [t.line() for t in timings],
            },
        )


def timing_step(
    tokens: int, block_size: int, num_blocks: int, groups: int, vocab: int, max_len: int, max_seqs: int
) -> list[ScheduledRequest] | None:
    """A mixed step to time: new prompts of `tokens` random ids in all from position 0, each at
    most `max_len` long (a replayed step's contexts fit the buffers' width) and at most `max_seqs`
    of them, in the pool's first blocks (nothing is cached before the engine serves: what they write
    there is overwritten before anyone reads it); None where the pool or the sequences cannot hold
    the step."""
    lengths = [max_len] * (tokens // max_len) + ([tokens % max_len] if tokens % max_len else [])
    if len(lengths) > max_seqs or sum(-(-n // block_size) for n in lengths) > num_blocks:
        return None
    ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(tokens)).tolist()
    step, first_id, first_block = [], 0, 0
    for i, n in enumerate(lengths):
        blocks = -(-n // block_size)
        table = list(range(first_block, first_block + blocks))
        step.append(synthetic_request(f"mixed-graph-timing-{i}", ids[first_id : first_id + n], 0, table, groups))
        first_id, first_block = first_id + n, first_block + blocks
    return step


def measure(
    sizes: Sequence[int],
    step_for: Callable[[int], list[ScheduledRequest] | None],
    eager: Callable[[list[ScheduledRequest]], torch.Tensor],
    replay: Callable[[list[ScheduledRequest]], torch.Tensor],
    sync: Callable[[], None],
    dtype: torch.dtype = torch.float32,
    timed: bool = True,
) -> tuple[list[MixedTiming], str | None]:
    """Each count of `sizes` (ascending) timed at the fewest tokens that pad up to it (at least 2: a
    one-token step is a decode), both paths alternated, each one's fastest of REPS after a warm-up
    run (Triton compiles there); stops after the first count whose replay lost, or where the pool
    cannot hold the step. The warm-up runs' outputs are compared first (graph_check.compare): a
    replay that disagrees with the eager step ends the walk, and the second value says how (None:
    every replay run agreed) - mixed steps must not replay then, whatever the speed. `timed`
    False: the comparisons alone, every count (what a start that read its limit from disk runs)."""
    timings: list[MixedTiming] = []
    smaller = 0
    for size in sizes:
        tokens = max(smaller + 1, 2)
        smaller = size
        if tokens > size:  # a count of one token: a step of one token a request is a decode
            continue
        step = step_for(tokens)
        if step is None:
            break
        wrong = compare(
            lambda: eager(step),  # noqa: B023 (called at once)
            lambda: replay(step),  # noqa: B023
            dtype,
            f"the replay of {size} rows ({tokens} tokens)",
        )
        if wrong is not None:
            return timings, wrong
        if not timed:
            continue
        runs: dict[str, list[float]] = {"eager": [], "replay": []}
        for _ in range(REPS):
            for name, path in (("eager", eager), ("replay", replay)):
                sync()
                t0 = time.perf_counter()
                path(step)
                sync()
                runs[name].append(time.perf_counter() - t0)
        timing = MixedTiming(size, tokens, 1e3 * min(runs["eager"]), 1e3 * min(runs["replay"]))
        timings.append(timing)
        if timing.replay_ms > timing.eager_ms:
            break
    return timings, None


def summary(limit: int, sizes: Sequence[int], how: str) -> str:
    """The log line of a choice."""
    if limit == 0:
        return f"mixed steps run eagerly ({how}: no captured count replayed faster than the eager step)"
    top = max(sizes, default=0)
    beyond = f"; larger ones eagerly (up to {top} captured)" if limit < top else ""
    return f"mixed steps of up to {limit} tokens replay a CUDA graph ({how}){beyond}"


def choose(
    graphs: StepGraphs,
    runner: ModelRunner,
    stored: StoredChoice,
    limit: int | None,
    num_blocks: int,
    dtype: torch.dtype,
    stages: Stages,
) -> None:
    """Mixed steps replay up to the count measured before (`limit`, read by `stored`; each kept
    count's replay compared with the eager step again), or up to where their replay times faster
    than the eager step now (then kept by `stored`); a timing that fails, or a replay that
    disagrees with the eager step, leaves them eager, said once."""
    captured = list(graphs.mixed_sizes)
    if "mixed" in graphs.failed:  # the failed capture said so
        return
    if not captured:  # a kept limit of 0: nothing captured, nothing to compare
        logger.info(summary(0, captured, f"measured before on this {stored.device_name}"))
        return
    measured_before = limit is not None
    config = runner.config
    groups = len(graphs.group_inputs)
    device = graphs.inputs.device
    assert graphs.mixed is not None  # mixed counts were captured
    max_seqs = graphs.mixed.max_seqs

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step_for(tokens: int) -> list[ScheduledRequest] | None:
        return timing_step(
            tokens, graphs.block_size, num_blocks, groups, config.vocab_size, graphs.max_context, max_seqs
        )

    what = "comparing" if measured_before else "timing"
    with stages.stage("mixed-step graphs", f"{what} {len(captured)} counts of mixed steps replayed against eager"):
        try:
            timings, wrong = measure(
                captured, step_for, runner.eager_hidden, lambda step: graphs.run(step, kind="mixed")[0], sync, dtype,
                timed=not measured_before,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 (mixed steps then run eagerly, as before a measurement)
            timings, wrong = [], f"{what} their graphs raised {type(e).__name__}: {e}"
    graphs.mixed_replays = 0  # the count of served steps that replayed (tests read it)
    if wrong is not None:  # not kept: checked again at the next start
        logger.warning("mixed steps run eagerly: %s", wrong)
        graphs.limit_mixed(0)
        return
    if limit is not None:
        logger.info(summary(limit, captured, f"measured before on this {stored.device_name}, each count checked now"))
        return
    limit = replay_limit(timings)
    graphs.limit_mixed(limit)
    stored.keep(limit, timings)
    logger.info(summary(limit, captured, f"timed on this {stored.device_name}"))
    for timing in timings:
        logger.info("  %s", timing.line())


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}: {build.cpu_model()}"
