"""lm-eval's loglikelihood traffic through the engine: requests that score their prompt (prompt
logprobs) and generate one token, as lm-eval's vLLM backend sends them. Prints the seconds a round
takes (median of the rounds) and the prompt tokens scored a second.

    python bench/loglikelihood.py [--requests 16] [--prompt 512] [--prompt-logprobs 1] [--rounds 3]
        [--model DIR | --model default] [--device cuda --dtype bfloat16] [--against TREE --pairs 3]

By default on a CPU with a random model of two layers 64 wide (bench/device/random_checkpoint.py
--shape tiny --byte-tokenizer); `--model default` is the embedded default model. Prefix caching is
off (a request scoring its prompt reads no cached prefix, as vLLM's). `--against TREE --pairs N`
runs this script here and in another checkout (a git worktree), alternated, and prints both trees'
medians and the median of the paired ratios.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.host_overhead import tiny_checkpoint, without_comparison  # noqa: E402
from bench.machine import describe  # noqa: E402
from prefixkv import LLM, SamplingParams  # noqa: E402

RESULT = re.compile(r"^round: ([0-9.]+) s")


def one_round(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    """Seconds to score every prompt (each request's output and prompt logprobs read)."""
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert all(o.prompt_logprobs is not None and len(o.prompt_logprobs) == len(p) for o, p in zip(outs, prompts))
    return seconds


def compare(tree: str, pairs: int, argv: list[str]) -> None:
    here = str(Path(__file__).resolve().parent.parent)
    times: dict[str, list[float]] = {here: [], tree: []}
    for i in range(pairs):
        for root in (here, tree) if i % 2 == 0 else (tree, here):
            run = subprocess.run(
                [sys.executable, "bench/loglikelihood.py", *argv], cwd=root, capture_output=True, text=True, check=True
            )
            times[root] += [float(m.group(1)) for line in run.stdout.splitlines() if (m := RESULT.match(line))]
        print(f"pair {i + 1}/{pairs} done", flush=True)
    mine, theirs = times[here], times[tree]
    ratios = [a / b for a, b in zip(mine, theirs)]
    print(
        f"a round: {statistics.median(mine):.3f} s here, {statistics.median(theirs):.3f} s in {tree} "
        f"(medians of {len(ratios)}); paired ratio {statistics.median(ratios):.2f} "
        f"(range {min(ratios):.2f}-{max(ratios):.2f})",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens a request")
    ap.add_argument("--prompt-logprobs", type=int, default=1, help="top logprobs a prompt position")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default=None, help="an HF checkpoint folder, or default (default: a tiny random one)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--against", default=None, help="another checkout of prefixkv: compare with it")
    ap.add_argument("--pairs", type=int, default=3)
    args = ap.parse_args()
    print(describe(), flush=True)
    if args.against:
        compare(args.against, args.pairs, without_comparison(sys.argv[1:]))
        return
    model = args.model or tiny_checkpoint(tempfile.mkdtemp(prefix="loglikelihood-"))
    llm = LLM(
        None if model == "default" else model,
        dtype=args.dtype,
        device=args.device,
        enable_prefix_caching=False,
        max_model_len=args.prompt + 8,
    )
    vocab = min(250, llm.llm_engine.model_config.vocab_size)
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt)] for _ in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=args.prompt_logprobs)
    one_round(llm, prompts, params)  # warm: every shape once
    times = [one_round(llm, prompts, params) for _ in range(args.rounds)]
    for t in times:
        print(f"round: {t:.4f} s", flush=True)
    median = statistics.median(times)
    scored = args.requests * (args.prompt - 1)
    print(f"median of {args.rounds}: {median:.3f} s a round, {scored / median:,.0f} prompt tokens scored a second")


if __name__ == "__main__":
    main()
