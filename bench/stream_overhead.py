"""The server's engine loop with B streamed requests at once: wall milliseconds per engine step,
outputs handed to the event loop and read there as the routes read them (`AsyncEngine.generate`),
on a model that costs little (a random two-layer model 64 wide with a byte-level vocabulary,
bench/device/random_checkpoint.py --shape tiny --byte-tokenizer). What the host spends per step
on streams beside the engine's own work (bench/host_overhead.py).

    python bench/stream_overhead.py [--batches 32,256] [--tokens 48] [--rounds 4] [--output-kind CUMULATIVE]

Prints per batch the rounds' ms per step and the median of all but the first (a warm-up).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.host_overhead import tiny_checkpoint  # noqa: E402
from bench.machine import describe  # noqa: E402
from prefixkv import SamplingParams  # noqa: E402
from prefixkv.config import EngineConfig  # noqa: E402
from prefixkv.engine.llm_engine import LLMEngine  # noqa: E402
from prefixkv.sampling_params import RequestOutputKind  # noqa: E402
from prefixkv.server.async_engine import AsyncEngine  # noqa: E402


async def one_round(engine: AsyncEngine, batch: int, params: SamplingParams, prompt: int, tag: str) -> None:
    async def one(i: int) -> None:
        ids = [32 + (7 * i + j) % 200 for j in range(prompt)]
        async for _ in engine.generate(ids, params, f"{tag}-{i}"):
            pass

    await asyncio.gather(*(one(i) for i in range(batch)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="32,256")
    ap.add_argument("--tokens", type=int, default=48, help="tokens generated per request")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens per request")
    ap.add_argument("--output-kind", default="CUMULATIVE", choices=[k.name for k in RequestOutputKind])
    ap.add_argument("--model", default=None, help="a checkpoint folder (default: a tiny random one, written here)")
    args = ap.parse_args()
    print(describe(), flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model if args.model is not None else tiny_checkpoint(tmp)
        engine = LLMEngine(
            EngineConfig(
                model=model,
                dtype="float32",
                device="cpu",
                max_num_seqs=max(batches),
                max_num_batched_tokens=max(2048, max(batches) * args.prompt),
                enable_prefix_caching=False,
                max_model_len=args.prompt + args.tokens + 8,
            )
        )
        async_engine = AsyncEngine(engine)
        async_engine.start()
        params = SamplingParams(
            temperature=0, max_tokens=args.tokens, ignore_eos=True, output_kind=RequestOutputKind[args.output_kind]
        )
        try:
            for batch in batches:
                per_step = []
                for r in range(args.rounds):
                    steps = engine.num_steps
                    start = time.perf_counter()
                    asyncio.run(one_round(async_engine, batch, params, args.prompt, f"b{batch}r{r}"))
                    per_step.append((time.perf_counter() - start) / (engine.num_steps - steps) * 1e3)
                rounds = ", ".join(f"{x:.2f}" for x in per_step)
                print(
                    f"batch {batch:4d}: {statistics.median(per_step[1:]):.2f} ms a step (rounds {rounds})", flush=True
                )
        finally:
            async_engine.shutdown()


if __name__ == "__main__":
    main()
