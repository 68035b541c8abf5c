"""`make demo`: the seed's long-document example on the embedded model.

A ~1,500-token markdown table, then two questions about it. The first question computes the
table's KV blocks; the second finds them in the prefix cache and computes only its own tokens.
"""
from __future__ import annotations

import time

from . import LLM, SamplingParams
from .scenarios import LONG_PROMPT, SEED_MAX_TOKENS, age_question


def main() -> None:
    t0 = time.perf_counter()
    llm = LLM(enable_prefix_caching=True)
    print(f"loaded the embedded SmolLM2-135M-Instruct in {time.perf_counter() - t0:.1f} s")
    tok = llm.get_tokenizer()
    print(f"document: {len(tok.encode(LONG_PROMPT))} tokens\n")
    params = SamplingParams(temperature=0, max_tokens=SEED_MAX_TOKENS)
    ttfts = []
    for name in ("John Doe", "Zack Blue"):
        start = time.perf_counter()
        out = llm.generate(LONG_PROMPT + age_question(name), params, use_tqdm=False)[0]
        total = time.perf_counter() - start
        ttft = out.metrics.time_to_first_token
        ttfts.append(ttft)
        print(f"Q: what is the age of {name}?")
        print(f"A: {out.outputs[0].text.strip()!r}")
        print(f"   time to first token {ttft:.3f} s, total {total:.2f} s, "
              f"{len(out.outputs[0].token_ids)} tokens, {out.num_cached_tokens} of "
              f"{len(out.prompt_token_ids)} prompt tokens from the cache\n")
    stats = llm.get_prefix_cache_stats()
    print(f"prefix cache: {stats.hits} of {stats.queries} queried tokens hit ({stats.hit_rate:.1%})")
    print(f"second question's time to first token = {ttfts[1] / ttfts[0]:.1%} of the first's")


if __name__ == "__main__":
    main()
