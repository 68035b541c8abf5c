"""Decode ms/step through the engine, decode steps replayed as CUDA graphs (with async scheduling,
each step launched before the previous one's tokens are read: a GPU's default) against
enforce_eager=True, against graphs stepped in order (async_scheduling=False) and against graphs of
PyTorch's norms, rotary and SiLU (PREFIXKV_CUDA_KERNELS=0, the fused Triton kernels off), in one
process, the engines alternated round by round.

    python bench/decode_graphs.py [--device cuda] [--dtype bfloat16] [--batches 1,32,256]
        [--context 256] [--steps 24] [--rounds 2] [--model PATH] [--engines graphs,eager,inorder,unfused]
        [--temperature 0.8 --top-p 0.9] [--repetition-penalty 1.1] [--regex '[a-z ]{200,}']

Per batch B: B prompts of --context random tokens are prefilled (in chunks of the engine's token
budget; sequences prefilled early decode meanwhile), then --steps engine steps in which every
sequence decodes one token (scheduling, the forward, sampling, outputs: what a user waits on) are
timed one by one; the median of every round's steps is printed per engine, with how many of
those steps the graphs took, and whether each engine's tokens agreed with the first one's (greedy,
or with --temperature drawn with a seed a request; a replayed sampled step draws in graphs too;
with --repetition-penalty or --regex (structured outputs; it must outlast the steps) the draws'
graph reads logits edited in place first, and the rows run ahead where the engine schedules ahead)
(bfloat16: the eager path's attention is another kernel, so a difference is possible, not a failure;
steps scheduled ahead compute the same steps, so in-order tokens must equal the graphs' own).

On CUDA the card's memory bandwidth is measured first (bench/ceiling.measure_cuda; `--no-ceiling`
skips it), and each batch's line is followed by the fastest engine's step against it: the bytes a
step must read (every weight once, each sequence's K and V) at the measured bandwidth, and the
step's time as a multiple of that read time (issue 40's goal for a 1B-8B model: within 1.5x).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.arg_types import ints, names  # noqa: E402
from bench.ceiling import decode_bytes, measure_cuda  # noqa: E402
from bench.machine import describe  # noqa: E402
from prefixkv import LLM, SamplingParams  # noqa: E402
from prefixkv.sampling_params import StructuredOutputsParams  # noqa: E402

# the engines --engines picks from, by what each changes from the default engine. "default" is
# "graphs" under its CPU name: a CPU never captures, so there it is the eager engine; "unfused" is the
# default engine with PyTorch's norms, rotary and SiLU (PREFIXKV_CUDA_KERNELS=0, set around its build)
VARIANTS: dict[str, dict[str, object]] = {
    "graphs": {},
    "default": {},
    "eager": {"enforce_eager": True},
    "async": {"async_scheduling": True},
    "inorder": {"async_scheduling": False},
    "unfused": {},
}


@contextlib.contextmanager
def environment(overrides: dict[str, str]):
    """The variables set for the block (an engine's build, its steps), then restored."""
    before = {k: os.environ.get(k) for k in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def graphs_summary(llm: LLM) -> str:
    """What an engine captured: its graphs' sizes, time and memory (or why none)."""
    graphs = llm.llm_engine.runner.graphs
    if graphs is None:
        return "no graphs"
    if not graphs.graphs:
        return "static buffers, not captured"
    mixed = f"; mixed steps replayed up to {graphs.mixed_sizes[-1]} tokens" if graphs.mixed_sizes else ""
    one_row = getattr(graphs, "one_row_timing", None)  # (an older tree: none)
    if one_row is not None:  # StepGraphs._choose_one_row's timing, and what it kept
        kept = "folded" if llm.llm_engine.runner.model.one_row_products else "layer by layer"
        mixed += f"; batch-1 step {one_row[1]:.1f} us folded, {one_row[0]:.1f} us layer by layer: {kept} kept"
    return f"graphs captured: {graphs.summary()}{mixed}"


def decode_steps(
    llm: LLM, prompts: list[list[int]], steps: int, sampling: SamplingParams
) -> tuple[list[float], int, list[list[int]]]:
    """Seconds of each all-decode step, how many of them replayed a graph, the tokens generated
    (`sampling`'s greedy, or its draws with a seed a request: the same tokens from every engine
    whose logits agree)."""
    engine = llm.llm_engine
    graphs = engine.runner.graphs
    replays = graphs.replays if graphs is not None else 0
    # the prompts take several steps to prefill where they exceed the token budget: the first
    # sequences decode meanwhile, and must still be decoding when the last one starts
    budget = engine.scheduler.max_num_batched_tokens
    prefill_steps = -(-sum(len(p) for p in prompts) // budget)
    params = sampling.clone(max_tokens=steps + 1 + prefill_steps, ignore_eos=True)
    ids = [engine.add_request(p, params.clone(seed=i) if not params.greedy else params) for i, p in enumerate(prompts)]
    times: list[float] = []
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        # every sequence got a token from one scheduled token: each decoded one
        if engine.last_step_num_tokens == len(prompts) == len(outs):
            times.append(dt)
        for o in outs:
            tokens[o.request_id] = list(o.outputs[0].token_ids)
    taken = (graphs.replays - replays) if graphs is not None else 0
    return times[:steps], taken, [tokens.get(i, []) for i in ids]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", type=ints, default=[1, 32, 256])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default=None, help="a checkpoint folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--kv-gib", type=float, default=4.0, help="each engine's KV cache (GiB)")
    ap.add_argument(
        "--engines",
        type=names(VARIANTS),
        default=["graphs", "eager", "inorder", "unfused"],
        help="graphs (the default engine; on a CPU call it default), eager (enforce_eager=True), "
        "inorder (async_scheduling=False), async (async_scheduling=True: on a GPU the default "
        "already), unfused (the default engine with "
        "PREFIXKV_CUDA_KERNELS=0: PyTorch's norms, rotary and SiLU)",
    )
    ap.add_argument("--no-ceiling", action="store_true", help="skip measuring the card's memory bandwidth")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampled steps (default: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0, help="(penalties edit the graph's logits)")
    ap.add_argument("--regex", default=None, help="structured outputs: each output matches it (one bitmask a step)")
    args = ap.parse_args()
    penalty = args.repetition_penalty
    structured = None if args.regex is None else StructuredOutputsParams(regex=args.regex)
    sampling = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, repetition_penalty=penalty, structured_outputs=structured
    )
    print(describe(), flush=True)
    bandwidth = None
    if not args.no_ceiling and torch.device(args.device).type == "cuda":
        ceiling = measure_cuda((getattr(torch, args.dtype),), args.device)
        bandwidth = ceiling.bytes_per_s
        print("the card's ceiling, measured now (bench/ceiling.py): " + "; ".join(ceiling.lines()), flush=True)
    batches = args.batches
    budget = 2048  # the engine's default token budget
    # room for the decode steps taken while the largest batch is still prefilling (decode_steps)
    prefill_steps = -(-max(batches) * args.context // budget)
    common = dict(
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=max(batches),
        max_num_batched_tokens=budget,
        kv_cache_memory_bytes=int(args.kv_gib * (1 << 30)),
        max_model_len=args.context + args.steps + prefill_steps + 16,
        enable_prefix_caching=False,  # random prompts share nothing; keep the steps alike
    )
    envs = {name: {"PREFIXKV_CUDA_KERNELS": "0"} if name == "unfused" else {} for name in VARIANTS}
    engines = {}
    for name in args.engines:
        t0 = time.perf_counter()
        with environment(envs[name]):  # a graph keeps the kernels it was captured with
            engines[name] = LLM(args.model, **VARIANTS[name], **common)
        print(f"{name}: built in {time.perf_counter() - t0:.1f} s; {graphs_summary(engines[name])}", flush=True)
    first = next(iter(engines))
    vocab = engines[first].llm_engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    for B in batches:
        prompts = torch.randint(100, vocab, (B, args.context), generator=g).tolist()
        times: dict[str, list[float]] = {name: [] for name in engines}
        taken: dict[str, int] = dict.fromkeys(engines, 0)
        outs: dict[str, list[list[int]]] = {}
        for _ in range(args.rounds):
            for name, llm in engines.items():
                with environment(envs[name]):
                    ts, n, toks = decode_steps(llm, prompts, args.steps, sampling)
                times[name] += ts[2:]  # the first steps after a prefill settle the allocator
                taken[name] += n
                outs[name] = toks
        line = f"decode batch {B} ctx {args.context}:"
        if not all(times.values()):
            print(f"decode batch {B}: no step decoded every sequence at once (the KV cache too small?)")
            continue
        base = statistics.median(times[first])
        for name in engines:
            ms = statistics.median(times[name])
            line += f"  {name} {ms * 1000:7.2f} ms/step ({taken[name]} graph steps"
            if name != first:
                same = sum(a == b for a, b in zip(outs[name], outs[first]))
                line += f", x{ms / base:.2f} of {first}, tokens equal in {same}/{B}"
            line += ")"
        print(line, flush=True)
        if bandwidth is not None:
            config = engines[first].llm_engine.model_config
            # the K/V read at the middle of the timed steps
            need = decode_bytes(config, getattr(torch, args.dtype), B, args.context + args.steps // 2)
            fastest = min(engines, key=lambda name: statistics.median(times[name]))
            ms = statistics.median(times[fastest])
            read_ms = need / bandwidth * 1e3
            print(
                f"  batch {B}: {need / 1e9:.3f} GB to read a step = {read_ms:.3f} ms at {bandwidth / 1e9:.0f} GB/s; "
                f"{fastest} took x{ms * 1e3 / read_ms:.2f} that ({100 * read_ms / (ms * 1e3):.0f}% of the bandwidth)",
                flush=True,
            )


if __name__ == "__main__":
    main()
