"""Mixed steps - a new prompt's prefill beside running decodes, what serving under arrivals runs -
through the engine: the default engine (mixed steps replayed up to the token count where their
replay timed faster than the eager step at its start, engine/mixed_graph_choice.py) against every
mixed step replayed (cudagraph_mode FULL), none (FULL_DECODE_ONLY: decode steps captured, mixed
steps eager) and enforce_eager=True, in one process, the engines alternated round by round: whether
the measured limit is where it should be.

    python bench/mixed_steps.py [--device cuda] [--dtype bfloat16] [--decodes 0,32,128]
        [--prompts 16,128,1024] [--context 256] [--repeats 8] [--rounds 2] [--model PATH]
        [--engines default,full,decode-only,eager,inorder]

Per (B decodes, P prompt tokens): B requests of --context random tokens are prefilled and left
decoding; then, --repeats times, one request of P random tokens and max_tokens=1 is added and the
engine stepped until its token comes back - its prefill runs in one step beside the B decodes (in
chunks, a step each, where B + P is over --budget; `--engines default,inorder` then times its
chunks scheduled ahead against every step in order), and
with async scheduling (a GPU's default) the step already in flight is booked first: the time a
user waits for a first token while others decode. Printed: each engine's median ms from the
request's arrival to its token, how many mixed steps replayed a graph, and whether each engine's
tokens equal the first engine's (bfloat16: eager attention is another kernel, so a difference is
possible, not a failure).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.arg_types import ints, names  # noqa: E402
from bench.decode_graphs import graphs_summary  # noqa: E402
from bench.machine import describe  # noqa: E402
from prefixkv import LLM, SamplingParams  # noqa: E402
from prefixkv.progress import show_info_logs  # noqa: E402

VARIANTS: dict[str, dict[str, object]] = {
    "default": {},
    "full": {"compilation_config": {"cudagraph_mode": "FULL"}},
    "decode-only": {"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}},
    "eager": {"enforce_eager": True},
    # steps in order: what a prompt in chunks made the steps beside it before its chunks ran ahead
    "inorder": {"async_scheduling": False},
}


def mixed_steps(
    llm: LLM, decoders: list[list[int]], prompts: list[list[int]], context_steps: int
) -> tuple[list[float], int, list[int]]:
    """Seconds from each of `prompts`' arrival to its token, beside the decoders; how many mixed
    steps replayed a graph; each prompt's token."""
    engine = llm.llm_engine
    graphs = engine.runner.graphs
    budget = engine.scheduler.max_num_batched_tokens
    before = graphs.mixed_replays if graphs is not None else 0
    long_run = SamplingParams(temperature=0, max_tokens=context_steps + 4 * len(prompts) + 64, ignore_eos=True)
    running = [engine.add_request(p, long_run) for p in decoders]
    while decoders and engine.last_step_num_tokens != len(decoders):  # until every decoder decodes
        engine.step()
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times, tokens = [], []
    for p in prompts:
        t0 = time.perf_counter()
        rid = engine.add_request(p, one)
        done = []
        # a prompt over the budget left by the decodes runs in chunks, a step each
        for _ in range(4 + -(-(len(decoders) + len(p)) // budget)):
            done = [o for o in engine.step() if o.request_id == rid]
            if done:
                break
        times.append(time.perf_counter() - t0)
        if not done or not done[0].finished:
            raise RuntimeError("the prompt's token took 4 steps more than its chunks")
        tokens.append(done[0].outputs[0].token_ids[0])
    for rid in running:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    taken = (graphs.mixed_replays - before) if graphs is not None else 0
    return times, taken, tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--decodes", type=ints, default=[0, 32, 128], help="running decodes beside each prompt")
    ap.add_argument("--prompts", type=ints, default=[16, 128, 1024], help="prompt lengths (tokens)")
    ap.add_argument("--context", type=int, default=256, help="the decodes' prompt length")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--model", default=None, help="a checkpoint folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--kv-gib", type=float, default=4.0, help="each engine's KV cache (GiB)")
    ap.add_argument("--engines", type=names(VARIANTS), default=["default", "full", "decode-only"])
    args = ap.parse_args()
    print(describe(), flush=True)
    show_info_logs()  # each engine's start-up lines: the mixed steps' timings and choice among them
    decodes, lengths = args.decodes, args.prompts
    common = dict(
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=max(decodes) + 1,
        max_num_batched_tokens=args.budget,
        kv_cache_memory_bytes=int(args.kv_gib * (1 << 30)),
        max_model_len=args.context + max(lengths) + 4 * args.repeats * args.rounds + 256,
        enable_prefix_caching=False,  # random prompts share nothing; keep the steps alike
    )
    engines = {}
    for name in args.engines:
        t0 = time.perf_counter()
        engines[name] = LLM(args.model, **VARIANTS[name], **common)
        print(f"{name}: built in {time.perf_counter() - t0:.1f} s; {graphs_summary(engines[name])}", flush=True)
    first = next(iter(engines))
    vocab = engines[first].llm_engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    for B in decodes:
        for P in lengths:
            if B + P > args.budget:
                print(f"{B} decodes + a {P}-token prompt: over the token budget {args.budget}, in chunks")
            decoders = torch.randint(100, vocab, (B, args.context), generator=g).tolist()
            times: dict[str, list[float]] = {name: [] for name in engines}
            taken = dict.fromkeys(engines, 0)
            outs: dict[str, list[int]] = {name: [] for name in engines}
            for _ in range(args.rounds):
                prompts = torch.randint(100, vocab, (args.repeats, P), generator=g).tolist()
                for name, llm in engines.items():
                    ts, n, toks = mixed_steps(llm, decoders, prompts, args.context)
                    times[name] += ts[1:]  # the first settles the allocator
                    taken[name] += n
                    outs[name] += toks
            line = f"{B:4d} decodes + {P:5d}-token prompt:"
            base = statistics.median(times[first])
            for name in engines:
                ms = statistics.median(times[name])
                line += f"  {name} {ms * 1000:7.2f} ms ({taken[name]} mixed replays"
                if name != first:
                    same = sum(a == b for a, b in zip(outs[name], outs[first]))
                    line += f", x{ms / base:.2f} of {first}, tokens equal {same}/{len(outs[first])}"
                line += ")"
            print(line, flush=True)


if __name__ == "__main__":
    main()
