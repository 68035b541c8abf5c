"""How far bfloat16 greedy outputs depend on batching and on the prefix cache (float32 ones do
not: the tests check that). 10 prompts of bench/scenarios.py (8 sharing a document, the seed's
2), 24 greedy tokens each, through LLM.generate one at a time and as one batch, with prefix
caching on and off.

    .venv/bin/python bench/bf16_agreement.py [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.scenarios import seed_prompts, shared_prefix_prompts  # noqa: E402
from prefixkv import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    prompts = shared_prefix_prompts(8, 0) + seed_prompts()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    runs = {}
    for caching in (True, False):
        llm = LLM(dtype=args.dtype, enable_prefix_caching=caching, kv_cache_memory_bytes=256 << 20)
        one_by_one = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        runs[caching] = (one_by_one, batched)

    def agree(a, b) -> str:
        return f"{sum(x == y for x, y in zip(a, b))} of {len(prompts)}"

    print(f"{args.dtype}: caching on vs off, one at a time: {agree(runs[True][0], runs[False][0])}")
    print(f"{args.dtype}: caching on vs off, batched:       {agree(runs[True][1], runs[False][1])}")
    print(f"{args.dtype}: one at a time vs batched (caching on): {agree(runs[True][0], runs[True][1])}")


if __name__ == "__main__":
    main()
