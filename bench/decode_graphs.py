"""Decode ms/step through the engine, decode steps replayed as CUDA graphs against enforce_eager=True
and against graphs with async scheduling (each step launched before the previous one's tokens are
read), in one process, the engines alternated round by round.

    python bench/decode_graphs.py [--device cuda] [--dtype bfloat16] [--batches 1,32,256]
        [--context 256] [--steps 24] [--rounds 2] [--model PATH] [--engines graphs,eager,async]

Per batch B: B prompts of --context random tokens are prefilled, then --steps engine steps in which
every sequence decodes one token (scheduling, the forward, sampling, outputs: what a user waits on)
are timed one by one; the median of every round's steps is printed per engine, with how many of
those steps the graphs took, and whether each engine's greedy tokens agreed with the first one's
(bfloat16: the eager path's attention is another kernel, so a difference is possible, not a failure;
async scheduling computes the same steps, so its tokens must equal the graphs' own).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.machine import describe  # noqa: E402
from prefixkv import LLM, SamplingParams  # noqa: E402


def decode_steps(llm: LLM, prompts: list[list[int]], steps: int) -> tuple[list[float], int, list[list[int]]]:
    """Seconds of each all-decode step, how many of them replayed a graph, the tokens generated."""
    engine = llm.llm_engine
    graphs = engine.runner.graphs
    replays = graphs.replays if graphs is not None else 0
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    times: list[float] = []
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        if engine.last_step_num_tokens == len(prompts):  # every sequence decoded one token
            times.append(dt)
        for o in outs:
            tokens[o.request_id] = list(o.outputs[0].token_ids)
    taken = (graphs.replays - replays) if graphs is not None else 0
    return times, taken, [tokens.get(i, []) for i in ids]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default=None, help="a checkpoint folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--kv-gib", type=float, default=4.0, help="each engine's KV cache (GiB)")
    ap.add_argument(
        "--engines",
        default="graphs,eager,async",
        help="graphs (the default engine; on a CPU call it default), eager (enforce_eager=True), "
        "async (the default engine + async_scheduling)",
    )
    args = ap.parse_args()
    print(describe(), flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    common = dict(
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=max(batches),
        kv_cache_memory_bytes=int(args.kv_gib * (1 << 30)),
        max_model_len=args.context + args.steps + 16,
        enable_prefix_caching=False,  # random prompts share nothing; keep the steps alike
    )
    # "default" is "graphs" under its CPU name: a CPU never captures, so there it is the eager engine
    variants = {"graphs": {}, "default": {}, "eager": {"enforce_eager": True}, "async": {"async_scheduling": True}}
    engines = {}
    for name in args.engines.split(","):
        t0 = time.perf_counter()
        engines[name] = LLM(args.model, **variants[name], **common)
        graphs = engines[name].llm_engine.runner.graphs
        what = "no graphs"
        if graphs is not None:
            what = f"graphs captured: {graphs.summary()}" if graphs.graphs else "static buffers, not captured"
        print(f"{name}: built in {time.perf_counter() - t0:.1f} s; {what}", flush=True)
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
                ts, n, toks = decode_steps(llm, prompts, args.steps)
                times[name] += ts[2:]  # the first steps after a prefill settle the allocator
                taken[name] += n
                outs[name] = toks
        line = f"decode batch {B} ctx {args.context}:"
        base = statistics.median(times[first])
        for name in engines:
            ms = statistics.median(times[name])
            line += f"  {name} {ms * 1000:7.2f} ms/step ({taken[name]} graph steps"
            if name != first:
                same = sum(a == b for a, b in zip(outs[name], outs[first]))
                line += f", x{ms / base:.2f} of {first}, tokens equal in {same}/{B}"
            line += ")"
        print(line, flush=True)


if __name__ == "__main__":
    main()
