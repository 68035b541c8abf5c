"""Multi-LoRA throughput: the default model with 1, 4 and 8 random rank-16 adapters on every linear
layer (q/k/v/o/gate/up/down), mixed traffic (requests round-robin over the adapters, each adapter
with its own shared system prompt), against the base model without LoRA in the same run.

Each configuration is one LLM; every repeat starts from an empty prefix cache (so the system
prompts are computed once per adapter and hit by the adapter's later requests), and base and LoRA
passes alternate (base, LoRA, base, LoRA, ...) so that load from other processes hits both alike.
Prints the median throughput (generated tokens / s, and all tokens / s), the median of the
per-pair LoRA/base ratios, and the prefix-cache hit rate.

    .venv/bin/python bench/lora.py [--requests 24] [--max-tokens 24] [--repeats 3] [--adapters 1,4,8]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from prefixkv import LLM, SamplingParams  # noqa: E402
from prefixkv.lora import LoRARequest  # noqa: E402
from prefixkv.lora.adapter import target_shapes  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(path: str, config, rank: int, seed: int) -> None:
    """A PEFT folder (adapter_config.json + adapter_model.safetensors) with random weights."""
    g = torch.Generator().manual_seed(seed)
    shapes = target_shapes(config)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for t in TARGETS:
            fan_in, fan_out = shapes[t]
            part = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            pre = f"base_model.model.model.layers.{layer}.{part}.{t}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            tensors[f"{pre}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none"}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)


def workload(n_requests: int, n_groups: int, seed: int) -> list[tuple[int, str]]:
    """(group, prompt): group g's requests share a ~200-token system prompt of their own."""
    rng = random.Random(seed)
    words = "alpha beta gamma delta river stone cloud maple orbit lantern copper meadow signal harbor".split()
    systems = [
        f"System {g}: you are assistant number {g}. " + " ".join(rng.choice(words) for _ in range(150))
        for g in range(n_groups)
    ]
    out = []
    for i in range(n_requests):
        g = i % n_groups
        q = " ".join(rng.choice(words) for _ in range(12))
        out.append((g, f"{systems[g]}\nQuestion {i}: {q}\nAnswer:"))
    return out


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
    ap.add_argument("--adapters", default="1,4,8")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    counts = [int(x) for x in args.adapters.split(",")]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    common = dict(dtype=args.dtype, device=args.device, kv_cache_memory_bytes=256 << 20)

    base = LLM(**common)
    config = base.llm_engine.model_config
    print(f"model: {config.architecture}, {config.num_hidden_layers} layers, hidden {config.hidden_size}")
    print(f"{args.requests} requests x {args.max_tokens} tokens, rank {args.rank}, median of {args.repeats}")
    results = []
    with tempfile.TemporaryDirectory(prefix="prefixkv-lora-bench-") as tmp:
        paths = []
        for i in range(max(counts)):
            p = os.path.join(tmp, f"adapter{i}")
            write_random_adapter(p, config, args.rank, seed=i)
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
