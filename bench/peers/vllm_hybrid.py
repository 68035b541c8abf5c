"""Peer benchmark: bench/hybrid.py's questions through vLLM (CPU), one after another.

    peers/vllm/bin/python bench/peers/vllm_hybrid.py --model FOLDER --prompts PROMPTS.json [--no-prefix-caching]

PROMPTS.json: a list of token-id lists (the shared prefix and each question), as bench/hybrid.py
writes it. Greedy, 4 tokens each, float32, enforce_eager, block size 16. After a warm-up on an
unrelated prompt and a prefix-cache reset, each question is sent alone after the one before
finished. Prints one JSON line: per question the time to first token (RequestOutput.metrics,
measured by vLLM from arrival to first token), num_cached_tokens and the tokens, and vLLM's
prefix-cache hit rate (cached prompt tokens over prompt tokens).
"""

from __future__ import annotations

import argparse
import json
import os

ENV_DEFAULTS = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--no-prefix-caching", action="store_true")
    args = ap.parse_args()
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    from vllm import LLM, SamplingParams, TokensPrompt

    with open(args.prompts) as f:
        prompts: list[list[int]] = json.load(f)
    llm = LLM(
        model=args.model,
        dtype="float32",
        enforce_eager=True,
        block_size=16,
        max_model_len=2048,
        enable_prefix_caching=not args.no_prefix_caching,
        disable_log_stats=False,  # fills RequestOutput.metrics (first-token latency)
    )
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], params, use_tqdm=False)
    llm.reset_prefix_cache()
    ttft, cached, tokens = [], [], []
    for p in prompts:
        out = llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0]
        metrics = out.metrics
        ttft.append(getattr(metrics, "first_token_latency", None) if metrics is not None else None)
        cached.append(out.num_cached_tokens or 0)
        tokens.append(list(out.outputs[0].token_ids))
    total = sum(len(p) for p in prompts)
    print(json.dumps({"ttft": ttft, "num_cached_tokens": cached, "hit_rate": sum(cached) / total, "tokens": tokens}))


if __name__ == "__main__":
    main()
