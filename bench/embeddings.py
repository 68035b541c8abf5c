"""Embeddings of documents sharing a long prefix, MEAN pooling: the stage-output cache on vs off.

N documents (default 64) share a ~1,500-token instruction/document prefix and differ in a short
tail. MEAN pooling needs every token's final hidden state, so without the stage-output cache each
document computes its whole prompt (a KV-only prefix cache cannot serve it); with the cache the
prefix's hidden states are read back from the cached blocks and only the tails are computed.
Each configuration is one LLM; every repeat starts from an empty cache, so the prefix is computed
once per repeat. Prints the median seconds, documents/s, and the ratio; checks that both
configurations give the same embeddings (float32, within rounding).

    .venv/bin/python bench/embeddings.py [--docs 64] [--prefix-words 1150] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prefixkv import LLM  # noqa: E402

WORDS = (
    "river mountain quiet engine paper lantern violet harbor copper signal garden winter orbit marble "
    "thunder canvas meadow silver anchor falcon ember willow summit prism"
).split()


def documents(n: int, prefix_words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    prefix = "Instruction: represent the following passage for retrieval. " + " ".join(
        rng.choice(WORDS) for _ in range(prefix_words)
    )
    return [f"{prefix}\nSection {i}: " + " ".join(rng.choice(WORDS) for _ in range(30)) for i in range(n)]


def run(stage_cache: bool, docs: list[str], repeats: int) -> tuple[float, Any, int]:
    import torch

    llm = LLM(enable_stage_output_cache=stage_cache, max_model_len=4096)
    llm.embed(["warm up"], pooling="mean", use_tqdm=False)
    times, vectors, cached = [], None, 0
    for r in range(repeats):
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.embed(docs, pooling="mean", use_tqdm=False)
        times.append(time.perf_counter() - t0)
        vectors = torch.tensor([o.outputs.embedding for o in outs])
        cached = sum(o.num_cached_tokens for o in outs)
        state = "on " if stage_cache else "off"
        print(f"  stage cache {state} repeat {r + 1}/{repeats}: {times[-1]:.2f} s", flush=True)
    assert vectors is not None
    return statistics.median(times), vectors, cached


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=64)
    ap.add_argument("--prefix-words", type=int, default=1150, help="about 1,500 tokens with the default model")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    docs = documents(args.docs, args.prefix_words)
    probe = LLM(max_model_len=4096)
    lengths = [len(probe.llm_engine.tokenize(d)) for d in docs]
    shared = len(probe.llm_engine.tokenize(docs[0].split("\nSection")[0]))
    del probe
    print(f"{len(docs)} documents, {statistics.median(lengths)} tokens each (median), ~{shared} shared; MEAN pooling")
    off, v_off, _ = run(False, docs, args.repeats)
    on, v_on, cached = run(True, docs, args.repeats)
    diff = (v_on - v_off).abs().max().item()
    print(f"stage cache off: {off:.2f} s median ({len(docs) / off:.2f} docs/s)")
    print(f"stage cache on : {on:.2f} s median ({len(docs) / on:.2f} docs/s), {cached} of {sum(lengths)} tokens cached")
    print(f"speed-up: {off / on:.2f}x; max |embedding on - off| = {diff:.2e}")


if __name__ == "__main__":
    main()
