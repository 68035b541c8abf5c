"""The routed-expert MLP of one mixture-of-experts layer at decode-step sizes: prefixkv's grouped
computation (model/moe.py: the step's (token, expert) pairs sorted by expert, two matmuls per active
expert, one index_add) against a per-token loop (each token, each of its k experts, one row at a
time) on the same random weights. The shape is Qwen3-30B-A3B's proportions scaled down to fit a
small machine: 128 experts, top 8, hidden 1024, expert intermediate 384 (the real model: 2048 and
768). Medians of --reps calls, float32, after checking that both give the same output.

    .venv/bin/python bench/moe.py --rows 1,4,16,64
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from prefixkv.model.config import ModelConfig  # noqa: E402
from prefixkv.model.moe import SparseMoeBlock  # noqa: E402


def per_token(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """The baseline: a Python loop over tokens and their experts."""
    index, weight = block.route(x)
    experts = block.experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(index.shape[1]):
            e = int(index[t, j])
            g, u = F.linear(x[t : t + 1], experts.gate_up_proj[e]).split(experts.intermediate, dim=-1)
            out[t] += weight[t, j] * F.linear(F.silu(g) * u, experts.down_proj[e])[0]
    return out


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def median_ms(fn, x, reps: int) -> float:
    fn(x)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(x)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,16,64", help="tokens in the step (comma separated)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=384)
    args = ap.parse_args()
    config = ModelConfig(
        architecture="Qwen3MoeForCausalLM",
        vocab_size=256,
        hidden_size=args.hidden,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=8,
        intermediate_size=args.intermediate,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.intermediate,
        norm_topk_prob=True,
    )
    torch.manual_seed(0)
    block = SparseMoeBlock(config).requires_grad_(False)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    mb = sum(p.numel() * p.element_size() for p in block.parameters()) / 2**20
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(
        f"{args.experts} experts top {args.top_k}, hidden {args.hidden}, "
        f"intermediate {args.intermediate} ({mb:.0f} MiB)"
    )
    print(f"{'rows':>5} {'grouped ms':>11} {'per-token ms':>13} {'speed-up':>9}")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, args.hidden)
            torch.testing.assert_close(block(x), per_token(block, x), atol=1e-5, rtol=1e-4)
            grouped = median_ms(block, x, args.reps)
            loop = median_ms(lambda v: per_token(block, v), x, args.reps)
            print(f"{rows:>5} {grouped:>11.3f} {loop:>13.3f} {loop / grouped:>8.1f}x")


if __name__ == "__main__":
    main()
