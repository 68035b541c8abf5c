"""32 prompts sharing one ~1,600-token document, each with its own short question, 16 output
tokens, greedy, submitted as one batch: total time and output tokens/s, prefix caching on and off.

    .venv/bin/python bench/shared_prefix.py [--repeats 3] [--peers]

With --peers, vLLM-CPU and llama.cpp run the same prompts (bench/peers/) and the ratios are printed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.peer_runner import (DEFAULT_LLAMACPP_PYTHON, DEFAULT_VLLM_MODEL, DEFAULT_VLLM_PYTHON,  # noqa: E402
                               available, run_peer)
from prefixkv import LLM, SamplingParams  # noqa: E402
from prefixkv.model.loader import default_model_path  # noqa: E402
from bench.scenarios import SHARED_MAX_TOKENS, shared_prefix_prompts  # noqa: E402


def run_prefixkv(caching: bool, repeats: int) -> dict:
    llm = LLM(enable_prefix_caching=caching)
    prompts = shared_prefix_prompts()
    params = SamplingParams(temperature=0, max_tokens=SHARED_MAX_TOKENS)
    llm.generate("Hello, my name is", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    times, texts = [], None
    for _ in range(repeats):
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
        t = [o.outputs[0].text for o in outs]
        assert texts is None or t == texts
        texts = t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    med = statistics.median(times)
    return {"seconds_median": med, "output_tok_per_s": n_out / med, "output_tokens": n_out,
            "prompt_tokens_total": sum(len(o.prompt_token_ids) for o in outs),
            "cached_tokens_total": sum(o.num_cached_tokens for o in outs), "texts": texts, "seconds": times}


def show(label: str, r: dict) -> None:
    cached = r["cached_tokens_total"]
    cached = cached[0] if isinstance(cached, list) else cached
    print(f"  {label:<28} {r['seconds_median']:8.2f} s  {r['output_tok_per_s']:7.1f} output tok/s"
          f"  cached {cached}/{r['prompt_tokens_total']} prompt tokens")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peers", action="store_true")
    ap.add_argument("--peer-repeats", type=int, default=None,
                    help="repeats for the peers (default: --repeats); llama.cpp without a cache is slow")
    args = ap.parse_args()
    print(f"shared prefix: 32 prompts, {SHARED_MAX_TOKENS} tokens each; medians of {args.repeats}; "
          f"load average {os.getloadavg()[0]:.1f}")
    on = run_prefixkv(True, args.repeats)
    off = run_prefixkv(False, args.repeats)
    show("prefixkv caching on", on)
    show("prefixkv caching off", off)
    print(f"  prefixkv on/off speed-up {off['seconds_median'] / on['seconds_median']:.1f}x; "
          f"outputs identical: {on['texts'] == off['texts']}")
    if not args.peers:
        return
    peer_repeats = str(args.peer_repeats or args.repeats)
    if available(DEFAULT_VLLM_PYTHON):
        v = run_peer(DEFAULT_VLLM_PYTHON, "vllm_generate.py", ["--model", DEFAULT_VLLM_MODEL, "--scenario",
                                                                "shared_prefix", "--repeats", peer_repeats])
        if v:
            show("vLLM caching on", v["prefix_caching_on"])
            show("vLLM caching off", v["prefix_caching_off"])
            print(f"  prefixkv / vLLM time, caching on: {on['seconds_median'] / v['prefix_caching_on']['seconds_median']:.2f}"
                  f" (below 1 = prefixkv faster); same texts as prefixkv: {v['prefix_caching_on']['texts'] == on['texts']}")
    if available(DEFAULT_LLAMACPP_PYTHON):
        ll = run_peer(DEFAULT_LLAMACPP_PYTHON, "llamacpp_generate.py",
                      ["--model", default_model_path(), "--scenario", "shared_prefix", "--repeats", peer_repeats])
        if ll:
            for key, label in (("prefix_caching_on", "llama.cpp cache on"), ("prefix_caching_off", "llama.cpp cache off")):
                if key in ll:
                    show(label, ll[key])


if __name__ == "__main__":
    main()
