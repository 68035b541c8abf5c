"""Offline prefill and decode times through each engine's own `LLM.generate`, the same script for
prefixkv and for vLLM (run it with each engine's Python): the time of one cold 478-token prompt
with one output token (prefix caching off), and the time per decode step at each of --batches (1
and 8) after --context-token prompts (256) ((time of 33 output tokens - time of 1) / 32). Prompts are random token ids
(seeded), the same for both engines. Medians; one JSON line at the end.

    .venv/bin/python bench/step_times.py --dtype bfloat16
    peers/vllm/bin/python bench/step_times.py --engine vllm --dtype bfloat16

vLLM runs as `vllm serve` would on this machine (its compiled model, not eager), engine core in
the process, `VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-1`; model: peers/smollm2-135m-hf
(bench/peers/README.md), the HF copy of the GGUF prefixkv embeds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="prefixkv", choices=["prefixkv", "vllm"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--prompt", type=int, default=478)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--batches", default="1,8", help="decode batch sizes")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens of each decoding sequence")
    ap.add_argument("--model", default=os.path.join(ROOT, "peers", "smollm2-135m-hf"), help="vLLM's HF folder")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.reps < 1 or args.prompt < 1 or args.context < 1 or min(batches) < 1:
        sys.exit("--reps, --prompt, --context and every batch must be at least 1")

    if args.engine == "vllm":
        for key, value in {
            "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_CPU_OMP_THREADS_BIND": "0-1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_LOGGING_STREAM": "ext://sys.stderr",
        }.items():
            os.environ.setdefault(key, value)
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=args.model, dtype=args.dtype, max_model_len=2048, enable_prefix_caching=False)

        def as_prompt(ids: list[int]) -> object:
            return TokensPrompt(prompt_token_ids=ids)

        def generate(prompts: list[object], max_tokens: int) -> None:
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            llm.generate(prompts, params, use_tqdm=False)
    else:
        sys.path.insert(0, ROOT)
        from prefixkv import LLM, SamplingParams

        llm = LLM(dtype=args.dtype, max_model_len=2048, enable_prefix_caching=False)

        def as_prompt(ids: list[int]) -> object:
            return {"prompt_token_ids": ids}

        def generate(prompts: list[object], max_tokens: int) -> None:
            llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))

    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    generate([as_prompt(ids(args.prompt))], 1)  # warm-up
    prefill = []
    for _ in range(args.reps):
        prompt = as_prompt(ids(args.prompt))
        t0 = time.perf_counter()
        generate([prompt], 1)
        prefill.append(time.perf_counter() - t0)
    result = {"engine": args.engine, "dtype": args.dtype, f"prefill_{args.prompt}_ms": statistics.median(prefill) * 1e3}
    for batch in batches:
        steps = []
        for _ in range(3):
            prompts = [as_prompt(ids(args.context)) for _ in range(batch)]
            t0 = time.perf_counter()
            generate(prompts, 1)
            one = time.perf_counter() - t0
            prompts = [as_prompt(ids(args.context)) for _ in range(batch)]
            t0 = time.perf_counter()
            generate(prompts, 33)
            steps.append((time.perf_counter() - t0 - one) / 32)
        result[f"decode_batch{batch}_ms"] = statistics.median(steps) * 1e3
    steps_text = ", ".join(f"batch {b} {result[f'decode_batch{b}_ms']:.1f} ms" for b in batches)
    print(
        f"{args.engine} {args.dtype}: prefill {args.prompt} tokens {result[f'prefill_{args.prompt}_ms']:.1f} ms; "
        f"decode step ({args.context}-token prompts) {steps_text}"
    )
    result["load_average"] = os.getloadavg()[0]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
