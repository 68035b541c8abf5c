"""Multi-LoRA throughput: the default model with 1, 4 and 8 random rank-16 adapters on every linear
layer (q/k/v/o/gate/up/down), mixed traffic (requests round-robin over the adapters, each adapter
with its own shared system prompt), against the base model without LoRA in the same run.

Each configuration is one LLM; every repeat starts from an empty prefix cache (so the system
prompts are computed once per adapter and hit by the adapter's later requests), and base and LoRA
passes alternate (base, LoRA, base, LoRA, ...) so that load from other processes hits both alike.
Prints the median throughput (generated tokens / s, and all tokens / s), the median of the
per-pair LoRA/base ratios, and the prefix-cache hit rate.

    .venv/bin/python bench/lora.py [--requests 24] [--max-tokens 24] [--repeats 3] [--adapters 1,4,8]
        [--device cuda --dtype bfloat16 [--enforce-eager]]

On a GPU both engines replay CUDA graphs (with LoRA, the graphs that carry the adapters); run it
again with --enforce-eager for both eagerly.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.arg_types import ints  # noqa: E402
from bench.lora_workload import workload, write_random_adapter  # noqa: E402
from prefixkv import LLM, SamplingParams  # noqa: E402
from prefixkv.lora import LoRARequest  # noqa: E402


def one_run(llm: LLM, prompts, loras, params) -> tuple[float, float, float]:
    """Generated tokens/s, all tokens/s and prefix hit rate of one pass from an empty cache."""
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    dt = time.perf_counter() - t0
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs)
    return gen / dt, (gen + prompt_tokens) / dt, cached / prompt_tokens


def alternate(base: LLM, llm: LLM, prompts, loras, params, repeats: int) -> list[float]:
    """Base and LoRA passes alternated (so load changes on a shared machine hit both alike).
    Returns the medians: base gen/s, LoRA gen/s, base all/s, LoRA all/s, base hit, LoRA hit, and
    the median of the per-pair ratios."""
    rows = []
    for _ in range(repeats):
        b = one_run(base, prompts, None, params)
        lo = one_run(llm, prompts, loras, params)
        rows.append((b[0], lo[0], b[1], lo[1], b[2], lo[2], lo[0] / b[0]))
    return [statistics.median(col) for col in zip(*rows)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--adapters", type=ints, default=[1, 4, 8])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--enforce-eager", action="store_true", help="on a GPU: no CUDA graphs, for either engine")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    counts = args.adapters
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    common = dict(
        dtype=args.dtype, device=args.device, kv_cache_memory_bytes=256 << 20, enforce_eager=args.enforce_eager
    )

    base = LLM(**common)
    config = base.llm_engine.model_config
    print(f"model: {config.architecture}, {config.num_hidden_layers} layers, hidden {config.hidden_size}")
    fields = ("hidden_size", "num_attention_heads", "head_dim", "num_key_value_heads", "intermediate_size")
    hf_fields = {f: getattr(config, f) for f in (*fields, "num_hidden_layers")}
    print(f"{args.requests} requests x {args.max_tokens} tokens, rank {args.rank}, median of {args.repeats}")
    results = []
    with tempfile.TemporaryDirectory(prefix="prefixkv-lora-bench-") as tmp:
        paths = []
        for i in range(max(counts)):
            p = os.path.join(tmp, f"adapter{i}")
            write_random_adapter(p, hf_fields, args.rank, seed=i)
            paths.append(p)
        for n in counts:
            groups = workload(args.requests, n, seed=n)
            prompts = [p for _, p in groups]
            llm = LLM(**common, enable_lora=True, max_loras=n, max_lora_rank=args.rank)
            loras = [LoRARequest(f"a{g}", g + 1, paths[g]) for g, _ in groups]
            one_run(base, prompts[:n], None, params)  # warm up both (not timed)
            one_run(llm, prompts[:n], loras[:n], params)  # and load every adapter once
            results.append((n, *alternate(base, llm, prompts, loras, params, args.repeats)))
            del llm
    print(
        "| adapters | base gen tok/s | LoRA gen tok/s | ratio | median pair ratio | base all tok/s "
        "| LoRA all tok/s | hit rate |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, bg, g, ba, a, bh, h, pair in results:
        print(
            f"| {n} | {bg:.1f} | {g:.1f} | {g / bg:.2f}x | {pair:.2f}x | {ba:.0f} | {a:.0f} | {h:.1%} (base {bh:.1%}) |"
        )
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
