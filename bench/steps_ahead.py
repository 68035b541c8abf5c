"""How many of an engine's steps async scheduling launches ahead (before the previous step's tokens
are read) under traffic that used to put steps in order, beside decodes: lm-eval's loglikelihood
requests (prompt logprobs, max_tokens 1), embeddings (a prompt's hidden states) and a pipeline's
thinker stage (return_hidden_states). A step in order makes a GPU wait for the host's booking; the
count is the same on any machine, so a CPU measures it.

    python bench/steps_ahead.py [--decodes 8] [--arrivals 40] [--model DIR | --model default]
        [--device cuda --dtype bfloat16 --rounds 3] [--kv-offloading-size GIB] [--num-blocks N]
        [--enable-stage-output-cache]

By default a random model of two layers 64 wide (bench/device/random_checkpoint.py --shape tiny
--byte-tokenizer). `--decodes` requests decode throughout (2 x arrivals + 8 tokens each); one request of the kind
arrives every second step until `--arrivals` have come. Prints per kind the steps, those launched ahead and their
share. On a GPU (`--device cuda`) it also times each kind's run with async scheduling and in order
(`--rounds` alternated rounds, medians): what the steps ahead buy there. A CPU computes a step when
it is launched, so there the times would say nothing and are not taken. `--kv-offloading-size`: both
engines save every completed block to a CPU tier, so that on a GPU the times say whether the tier's
copies hold the host (tiers/transfer.py). `--num-blocks`: a KV cache that small (default 1,024 blocks of
16) makes the batch outgrow it, and steps scheduled ahead preempt; the preemptions are printed.
`--enable-stage-output-cache`: both engines keep every step's hidden states per block, written when
the step is booked; a step reading them back (a request of the kind over a cache hit) runs in order.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.host_overhead import tiny_checkpoint  # noqa: E402
from bench.machine import describe  # noqa: E402
from prefixkv import LLM, SamplingParams  # noqa: E402

KINDS = {
    "loglikelihood": (SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), None),
    "embedding": (SamplingParams(temperature=0, max_tokens=1), 0),
    "thinker": (SamplingParams(temperature=0, max_tokens=4, return_hidden_states=True), None),
    "plain": (SamplingParams(temperature=0, max_tokens=4), None),
}


def share_ahead(llm: LLM, kind: str, decodes: int, arrivals: int, seed: int = 0) -> tuple[int, int, float]:
    """(steps, steps launched ahead, seconds) of `llm` serving `decodes` decodes and `arrivals`
    requests of `kind`, one every second step."""
    rng = random.Random(seed)
    engine = llm.llm_engine
    steps_before, ahead_before = engine.num_steps, engine.num_steps_ahead
    vocab = min(250, engine.model_config.vocab_size)
    decode = SamplingParams(temperature=0, max_tokens=2 * arrivals + 8, ignore_eos=True)
    start = time.perf_counter()
    for i in range(decodes):
        engine.add_request([rng.randrange(vocab) for _ in range(12)], decode, request_id=f"decode-{i}")
    params, hidden_from = KINDS[kind]
    step = came = 0
    while engine.has_unfinished_requests() or came < arrivals:
        step += 1
        if step % 2 == 0 and came < arrivals:
            came += 1
            prompt = [rng.randrange(vocab) for _ in range(24)]
            engine.add_request(prompt, params, request_id=f"{kind}-{came}", hidden_states_from=hidden_from)
        engine.step()
    seconds = time.perf_counter() - start
    return engine.num_steps - steps_before, engine.num_steps_ahead - ahead_before, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decodes", type=int, default=8)
    ap.add_argument("--arrivals", type=int, default=40)
    ap.add_argument("--model", default=None, help="an HF checkpoint folder, or default (default: a tiny random one)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=3, help="on a GPU: timed rounds of each engine")
    ap.add_argument("--kv-offloading-size", type=float, default=None, help="GiB of CPU tier under both engines")
    ap.add_argument("--num-blocks", type=int, default=1024, help="KV blocks of 16 tokens (small: preemptions)")
    ap.add_argument("--enable-stage-output-cache", action="store_true", help="hidden states kept per block")
    args = ap.parse_args()
    print(describe())
    model = args.model or tiny_checkpoint(tempfile.mkdtemp(prefix="steps-ahead-"))
    timed = args.device != "cpu"

    def engine(async_scheduling: bool) -> LLM:
        return LLM(
            None if model == "default" else model,
            dtype=args.dtype,
            device=args.device,
            num_blocks=args.num_blocks,
            block_size=16,
            async_scheduling=async_scheduling,
            kv_offloading_size=args.kv_offloading_size,
            enable_stage_output_cache=args.enable_stage_output_cache,
        )

    ahead, in_order = engine(True), engine(False) if timed else None
    for kind in KINDS:
        preempted = ahead.llm_engine.scheduler.num_preemptions
        steps, launched, _ = share_ahead(ahead, kind, args.decodes, args.arrivals)
        line = f"{kind:14s} {steps:4d} steps, {launched:4d} launched ahead ({100 * launched / steps:.0f}%)"
        if ahead.llm_engine.scheduler.num_preemptions > preempted:
            line += f", {ahead.llm_engine.scheduler.num_preemptions - preempted} preemptions"
        if in_order is not None:
            share_ahead(in_order, kind, args.decodes, args.arrivals)  # warm, as the count's run warmed the other
            times: dict[str, list[float]] = {"ahead": [], "in order": []}
            for _ in range(args.rounds):
                for name, llm in (("ahead", ahead), ("in order", in_order)):
                    times[name].append(share_ahead(llm, kind, args.decodes, args.arrivals)[2])
            a, b = statistics.median(times["ahead"]), statistics.median(times["in order"])
            line += f"; the run {a:.3f} s ahead, {b:.3f} s in order ({a / b:.2f}x)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
