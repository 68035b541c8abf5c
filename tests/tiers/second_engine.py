"""Run as a separate process by the tests: an engine on a tier that another process filled.
argv: model folder, --kv-tier spec, prompt token ids (comma list). Prints one JSON line."""

from __future__ import annotations

import json
import sys

from prefixkv import LLM, SamplingParams


def main() -> None:
    model, spec, ids = sys.argv[1], sys.argv[2], [int(t) for t in sys.argv[3].split(",")]
    llm = LLM(model=model, block_size=4, num_blocks=32, dtype="float32", device="cpu", kv_tier=spec)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    engine = llm.llm_engine
    kv = engine.scheduler.kv_cache_manager
    stats = engine.get_stats()
    print(
        json.dumps(
            {
                "tokens": out.outputs[0].token_ids,
                "cached": out.num_cached_tokens,
                "hits": [t.hits for t in stats.kv_tiers],
                "all_free": kv.num_free_blocks == kv.num_blocks,
            }
        )
    )


if __name__ == "__main__":
    main()
