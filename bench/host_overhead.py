"""The engine's own work per decode step, apart from the model: scheduling, the runner's input
preparation and sampling, the outputs (detokenizing, stop checks, building RequestOutputs). On a GPU
this is what a step costs beyond the device's time, and at large batches it can be most of it: on
an H100 a decode step of the default model at batch 256 took 9.45 ms, and 9.00 ms with async
scheduling hiding the host's work behind the device's.

    python bench/host_overhead.py [--batches 1,32,256] [--steps 40] [--rounds 3] [--output-kind FINAL_ONLY]
        [--temperature 0.8 --top-p 0.9] [--repetition-penalty 1.1 --frequency-penalty 0.5] [--logprobs 5]
        [--regex '[a-z ]+']
        [--device cuda --dtype bfloat16 --device-time] [--profile-top 25] [--model DIR | --model default]
        [--against TREE --pairs 4]

By default on a CPU, with a random model of two layers 64 wide and a byte-level vocabulary of 258
tokens (bench/device/random_checkpoint.py --shape tiny --byte-tokenizer), so that the forward, the
logits and the sampling cost little; each phase is timed around the engine's own methods. Prints
per phase the microseconds per request per step (the median of the rounds), and the host's total:
the step less the model's forward.

On a GPU (`--device cuda`; the engine's defaults there: CUDA graphs, async scheduling) a replayed
step calls no forward, and with async scheduling the phases overlap the device's work, so the
step's time is the larger of the two. `--device-time` profiles one more round (torch.profiler):
the device kernels a step launches and the time the device is busy per step, beside the step's
wall time - which of host and device bounds it; `--profile-top N` adds that round's operators and
CUDA runtime calls by host time and its kernels by device time. `--profile-top N` alone (a CPU too):
one more round under cProfile, N rows.
`--model default` is the embedded default model.

`--gpu-path` measures a GPU's host work on a CPU: decode steps through the fixed buffers a CUDA
graph replays (PREFIXKV_CUDA_GRAPHS=static under Triton's interpreter), their forward stubbed (a
replay costs the host one launch; a decode graph's LM head, row checks and argmax with it, and a
sampled step's draws graph another: graph_sampling.py) and
async scheduling on, as a GPU runs them by default. An LM head run outside a graph (a step whose
logits the graph does not compute), which a GPU runs on the device, is timed apart ("logits") and
left out of the host's total. Constraints (`--regex`) are applied as on a GPU, one bitmask a step;
the bitmask's unpacking and masking, a GPU's work, count as the host's here.

`--against TREE --pairs N` compares this tree's host work with another checkout's (a git worktree
at an earlier commit): N pairs of runs, the two trees alternated (a noisy machine drifts between
runs; which one goes first alternates too), then per batch each tree's median and the median of
the pairs' ratios. On a 2-vCPU VM one tree's runs varied 1.5x; a change is read from the ratios.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402

from bench.arg_types import ints  # noqa: E402
from bench.machine import describe  # noqa: E402
from prefixkv import LLM, SamplingParams  # noqa: E402
from prefixkv.sampling_params import RequestOutputKind, StructuredOutputsParams  # noqa: E402

PHASES = ("schedule", "runner launch", "model forward", "logits", "update_from_output", "process_outputs")


def timed(obj: Any, name: str, label: str, acc: dict[str, float]) -> None:
    """Wrap obj.name so that its time accumulates under acc[label]."""
    real: Callable[..., Any] = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            acc[label] += time.perf_counter() - t0

    setattr(obj, name, wrapper)


def tiny_checkpoint(folder: str) -> str:
    """A random model of two layers 64 wide with a byte-level vocabulary, written in `folder`:
    a model whose forward, logits and sampling cost little beside the engine's own work."""
    path = str(Path(folder) / "tiny")
    script = Path(__file__).resolve().parent / "device" / "random_checkpoint.py"
    tiny = ["--shape", "tiny", "--device", "cpu", "--byte-tokenizer"]
    subprocess.run([sys.executable, str(script), path, *tiny], check=True)
    return path


def host_profile(engine: Any, batch: int, prompt: int, params: SamplingParams, top: int) -> None:
    """One more round under cProfile: the Python functions of a decode step by their own time (the
    CUDA runtime's calls, which torch.profiler names, show here inside PyTorch's methods)."""
    import cProfile
    import io
    import pstats

    for i in range(batch):
        engine.add_request([32 + (7 * i + j) % 200 for j in range(prompt)], params)
    engine.step()  # the prefill, outside the profile
    prof = cProfile.Profile()
    steps = 0
    prof.enable()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    print(f"batch {batch:4d}: cProfile of {steps} decode steps, by own time:", flush=True)
    print("\n".join(out.getvalue().splitlines()[4:]), flush=True)


def device_time(engine: Any, batch: int, prompt: int, params: SamplingParams, top: int = 0) -> None:
    """One more round under torch.profiler: device kernels (and copies) a decode step, the device's
    busy time a step (their durations summed), against the step's wall time. `top`: also the
    operators and runtime calls by host time (cudaEventSynchronize is the host waiting for the
    device; cudaHostAlloc a page-locked allocation) and the kernels by device time, `top` rows each."""
    from torch.profiler import ProfilerActivity, profile

    for i in range(batch):
        engine.add_request([32 + (7 * i + j) % 200 for j in range(prompt)], params)
    engine.step()  # the prefill, outside the profile
    activities = [ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    steps = 0
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        wall = (time.perf_counter() - start) / steps * 1e3
    on_device = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not on_device:
        print(f"batch {batch:4d}: {wall:.3f} ms a step under the profiler; no device kernels here", flush=True)
    else:
        busy = sum(e.time_range.elapsed_us() for e in on_device) / steps / 1e3
        print(
            f"batch {batch:4d}: {wall:.3f} ms a step under the profiler, the device busy {busy:.3f} ms of it "
            f"({len(on_device) / steps:.0f} kernels and copies a step)",
            flush=True,
        )
    if top:
        table = prof.key_averages()
        print(
            f"batch {batch:4d}: {steps} steps by host time\n"
            + table.table(sort_by="self_cpu_time_total", row_limit=top)
        )
        if on_device:
            print(f"batch {batch:4d}: by device time\n" + table.table(sort_by="self_device_time_total", row_limit=top))


HOST_LINE = re.compile(r"^batch +(\d+): host +([\d.]+) us")


def compare(tree: str, pairs: int, argv: list[str]) -> None:
    """Run this script (without --against/--pairs) here and in `tree`, alternated, and print per
    batch the two trees' medians and the median (and range) of the paired ratios here / there."""
    here = str(Path(__file__).resolve().parent.parent)
    script = Path("bench") / "host_overhead.py"
    hosts: dict[str, dict[int, list[float]]] = {here: {}, tree: {}}
    for i in range(pairs):
        for root in (here, tree) if i % 2 == 0 else (tree, here):
            run = subprocess.run(
                [sys.executable, str(script), *argv], cwd=root, capture_output=True, text=True, check=True
            )
            for line in run.stdout.splitlines():
                m = HOST_LINE.match(line)
                if m:
                    hosts[root].setdefault(int(m.group(1)), []).append(float(m.group(2)))
        print(f"pair {i + 1}/{pairs} done", flush=True)
    for batch, mine in sorted(hosts[here].items()):
        theirs = hosts[tree].get(batch, [])
        ratios = [a / b for a, b in zip(mine, theirs)]
        if not ratios:
            continue
        print(
            f"batch {batch:4d}: host {statistics.median(mine):.1f} here, {statistics.median(theirs):.1f} in {tree} "
            f"(us a request a step, medians of {len(ratios)}); paired ratio {statistics.median(ratios):.2f} "
            f"(range {min(ratios):.2f}-{max(ratios):.2f})",
            flush=True,
        )


def without_comparison(argv: list[str]) -> list[str]:
    """argv less --against and --pairs (and their values): what each compared run is given."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--against", "--pairs"):
            skip = True
        elif not arg.startswith(("--against=", "--pairs=")):
            out.append(arg)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", default=None, help="another checkout of prefixkv (a git worktree): compare with it")
    ap.add_argument("--pairs", type=int, default=4, help="with --against: pairs of alternated runs")
    ap.add_argument("--batches", type=ints, default=[1, 32, 256])
    ap.add_argument("--steps", type=int, default=40, help="decode steps timed per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens per request")
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy; else unseeded draws (what chat clients send)"
    )
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0, help="(penalties read each request's output)")
    ap.add_argument("--frequency-penalty", type=float, default=0.0)
    ap.add_argument("--logprobs", type=int, default=None, help="top logprobs a request asks for")
    ap.add_argument("--regex", default=None, help="structured outputs: each request's output matches this regex")
    ap.add_argument(
        "--output-kind",
        default="FINAL_ONLY",
        choices=[k.name for k in RequestOutputKind],
        help="FINAL_ONLY: what LLM.generate and the server's unstreamed requests ask for; CUMULATIVE, DELTA: streams",
    )
    ap.add_argument(
        "--model", default=None, help="a checkpoint folder, or 'default' (default: a tiny random one, written here)"
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device-time", action="store_true", help="profile a round: kernels and busy time a step")
    ap.add_argument(
        "--profile-top",
        type=int,
        default=0,
        help="a round under cProfile, and with --device-time the profiled round's operators by host and "
        "device time, this many rows each",
    )
    ap.add_argument(
        "--gpu-path",
        action="store_true",
        help="a CPU: the GPU's decode path (the graphs' buffers, their forward stubbed, async scheduling)",
    )
    args = ap.parse_args()
    if args.against is not None:
        print(describe(), flush=True)
        compare(args.against, args.pairs, without_comparison(sys.argv[1:]))
        return
    gpu_path: dict[str, Any] = {}
    if args.gpu_path:
        if args.device != "cpu":
            raise SystemExit("--gpu-path stands in for a GPU on a CPU: not with --device")
        os.environ.update(TRITON_INTERPRET="1", PREFIXKV_CUDA_GRAPHS="static")
        gpu_path = dict(async_scheduling=True, compilation_config={"cudagraph_capture_sizes": args.batches})
    print(describe(), flush=True)
    batches = args.batches
    acc: dict[str, float] = collections.defaultdict(float)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model if args.model is not None else tiny_checkpoint(tmp)
        llm = LLM(
            None if model == "default" else model,
            dtype=args.dtype,
            device=args.device,
            max_num_seqs=max(batches),
            max_num_batched_tokens=max(2048, max(batches) * args.prompt),
            enable_prefix_caching=False,
            max_model_len=args.prompt + args.steps + 8,
            **gpu_path,
        )
        engine = llm.llm_engine
        if args.gpu_path:
            graphs = engine.runner.graphs
            assert graphs is not None, "no static buffers: is Triton installed?"
            rows = max([*batches, *graphs.mixed_sizes])
            stub = torch.zeros(rows, engine.model_config.hidden_size)
            # what a decode graph's tail leaves (cuda_graphs.DecodeTail): finite rows, token 0
            tail = (torch.ones(rows, dtype=torch.bool), torch.zeros(rows, dtype=torch.long))
            if getattr(graphs, "logits", None) is not None:  # the stub's logits: zeros, as its hidden states give
                with torch.inference_mode():
                    graphs.logits.zero_()

            def replay(kind: str, size: int) -> torch.Tensor:  # one launch, nothing for the host
                if kind.startswith("decode") and size <= getattr(graphs, "tail_rows", 0):  # (an older tree: none)
                    graphs._tails[kind, size] = (tail[0][:size], tail[1][:size], tail[1][:size])
                    if args.regex is not None:  # constraints edit the logits in place: the next step's are new
                        graphs.logits[:size].zero_()
                return stub[:size]

            graphs._forward = replay
            sampling = getattr(graphs, "sampling", None)  # a sampled step's draws (an older tree: none)
            if sampling is not None:

                def draws(logits: torch.Tensor, sort: bool) -> tuple[torch.Tensor, torch.Tensor]:  # one launch
                    if args.regex is not None:  # a token the constraints allow (the logits edited in place)
                        best = logits.argmax(dim=-1)
                        return best, best
                    return tail[1][: logits.shape[0]], tail[1][: logits.shape[0]]

                sampling.replay = draws
                if hasattr(sampling, "scores"):  # the scores of rows asking for logprobs (an older tree: none)
                    top = sampling.top_k
                    scored = (
                        torch.zeros(rows),
                        torch.ones(rows, dtype=torch.long),
                        torch.zeros(rows, top),
                        torch.zeros(rows, top, dtype=torch.long),
                    )

                    def scores(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:  # one launch
                        return tuple(t[: logits.shape[0]] for t in scored)

                    sampling.scores = scores
            if hasattr(
                engine.runner, "constraint_masks"
            ):  # constraints as a GPU applies them (an older tree: on the host)
                engine.runner.constraint_masks = True
            timed(engine.scheduler, "schedule_ahead", "schedule", acc)
            timed(engine.runner.model, "compute_logits", "logits", acc)
        timed(engine.scheduler, "schedule", "schedule", acc)
        timed(engine.scheduler, "update_from_output", "update_from_output", acc)
        timed(engine.groups, "process_outputs", "process_outputs", acc)
        timed(engine.runner, "launch", "runner launch", acc)
        timed(engine.runner.model, "forward", "model forward", acc)
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            repetition_penalty=args.repetition_penalty,
            frequency_penalty=args.frequency_penalty,
            logprobs=args.logprobs,
            structured_outputs=None if args.regex is None else StructuredOutputsParams(regex=args.regex),
            max_tokens=args.steps + 1,
            ignore_eos=True,
            output_kind=RequestOutputKind[args.output_kind],
        )
        for B in batches:
            per_round: dict[str, list[float]] = collections.defaultdict(list)
            for _ in range(args.rounds + 1):  # the first round warms up
                for i in range(B):
                    engine.add_request([32 + (7 * i + j) % 200 for j in range(args.prompt)], params)
                engine.step()  # the prefill
                acc.clear()
                steps, total, ahead_before = 0, 0.0, engine.num_steps_ahead
                while engine.has_unfinished_requests():
                    t0 = time.perf_counter()
                    engine.step()
                    total += time.perf_counter() - t0
                    steps += 1
                for phase in PHASES:
                    per_round[phase].append(acc[phase] / steps / B * 1e6)
                per_round["step"].append(total / steps / B * 1e6)
                per_round["ahead"].append((engine.num_steps_ahead - ahead_before) / steps)
            med = {k: statistics.median(v[1:]) for k, v in per_round.items()}
            device_work = med["model forward"] + med["logits"]
            host = med["step"] - device_work
            launch_own = med["runner launch"] - device_work
            print(
                f"batch {B:4d}: host {host:6.1f} us/request/step ({host * B / 1000:.2f} ms a step) = "
                f"schedule {med['schedule']:.1f} + runner {launch_own:.1f} (inputs, sampling) + "
                f"update {med['update_from_output']:.1f} + outputs {med['process_outputs']:.1f} + rest "
                f"{host - med['schedule'] - launch_own - med['update_from_output'] - med['process_outputs']:.1f}; "
                f"model forward {med['model forward']:.1f}"
                + (f", logits {med['logits']:.1f}" if args.gpu_path else "")
                + f"; {med['ahead']:.0%} of steps scheduled ahead",
                flush=True,
            )
            if args.device_time:
                try:
                    device_time(engine, B, args.prompt, params, args.profile_top)
                except Exception as e:  # noqa: BLE001 (a profiler that cannot run here: say so, go on)
                    print(f"batch {B:4d}: no device profile ({type(e).__name__}: {e})", flush=True)
            if args.profile_top:
                host_profile(engine, B, args.prompt, params, args.profile_top)


if __name__ == "__main__":
    main()
