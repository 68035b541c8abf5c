"""Run as a separate process by the tests: an offline LLM on a disk tier whose writes each take
argv[3] seconds (a slow disk), one request, then the script simply ends - no flush, no close.
argv: model folder, disk folder, seconds per write, prompt token ids (comma list)."""

from __future__ import annotations

import sys
import time

from prefixkv import LLM, SamplingParams
from prefixkv.tiers.disk import DiskStore


def main() -> None:
    model, folder, delay, ids = sys.argv[1], sys.argv[2], float(sys.argv[3]), [int(t) for t in sys.argv[4].split(",")]
    real_put = DiskStore.put

    def slow_put(self: DiskStore, key: bytes, value: bytes) -> None:
        time.sleep(delay)
        real_put(self, key, value)

    DiskStore.put = slow_put  # type: ignore[method-assign]
    llm = LLM(model=model, block_size=4, num_blocks=32, dtype="float32", device="cpu", kv_tier=f"disk:{folder}")
    llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))


if __name__ == "__main__":
    main()
