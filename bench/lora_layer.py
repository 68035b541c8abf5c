"""Per-decoder-layer cost of prefixkv's two mixed-batch LoRA paths (prefixkv/lora/layers.py) against
the base linears alone: the four wrapped linears of one layer of the default model's shape
(hidden 576, intermediate 1536, 9 query / 3 KV heads of 64), `--adapters` resident random
rank-`--rank` adapters on every target, two requests per adapter.

- decode: one token per request (the dense masked path: one shrink over all slots, one expand per target)
- prefill: `--prefill-tokens` per request (run by run: one shrink and one expand per run and target)
- each shape is also timed on the path the engine does not pick for it, to show why it does not

Medians of `--rounds` rounds (base and LoRA alternated), each the median of many calls.

    .venv/bin/python bench/lora_layer.py [--threads 1] [--adapters 8] [--rank 16] [--prefill-tokens 110]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from prefixkv.lora.layers import LoRAContext, LoRALinear, LoRAMapping  # noqa: E402

HIDDEN, INTER, Q, KV = 576, 1536, 576, 192
MODULES = {
    "qkv": (HIDDEN, [Q, KV, KV]),
    "o": (Q, [HIDDEN]),
    "gate_up": (HIDDEN, [INTER, INTER]),
    "down": (INTER, [HIDDEN]),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prefill-tokens", type=int, default=110)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    n, rank = args.adapters, args.rank
    context = LoRAContext()
    layers = {}
    for name, (fan_in, slices) in MODULES.items():
        lin = LoRALinear(torch.nn.Linear(fan_in, sum(slices), bias=False), fan_in, slices, context, n, rank,
                         torch.float32, "cpu")  # fmt: skip
        for slot in range(n):
            lin.set_slot(
                slot, [(torch.randn(rank, fan_in, generator=g), torch.randn(w, rank, generator=g)) for w in slices]
            )
        layers[name] = lin

    @torch.inference_mode()
    def timed(mapping: LoRAMapping | None, tokens: int, calls: int) -> float:
        xs = {name: torch.randn(tokens, fan_in) for name, (fan_in, _) in MODULES.items()}
        context.mapping = mapping
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            for name, lin in layers.items():
                lin(xs[name])
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    print(
        f"{n} adapters, rank {rank}, {args.threads} thread(s); per layer (4 linears), medians of {args.rounds} rounds"
    )
    print("| step | tokens | path | base | with LoRA | ratio |")
    print("|---|---:|---|---:|---:|---:|")
    for step, per_request, calls in (("decode", 1, 200), ("prefill", args.prefill_tokens, 10)):
        segments = [(i % n, per_request) for i in range(2 * n)]
        tokens = per_request * 2 * n
        picked = LoRAMapping.from_segments(segments, "cpu", n, rank)
        assert picked is not None
        runs = LoRAMapping([(slot, i * per_request, (i + 1) * per_request) for i, (slot, _) in enumerate(segments)])
        # the same tokens as one-token runs of alternating adapters: the dense path
        dense_segments = [(slot, 1) for _ in range(per_request) for slot, _ in segments]
        dense = LoRAMapping.from_segments(dense_segments, "cpu", n, rank)
        assert dense is not None and dense.dense is not None
        for label, mapping in (("dense (masked)", dense), ("run by run", runs)):
            base_t, lora_t = [], []
            for _ in range(args.rounds):
                base_t.append(timed(None, tokens, calls))
                lora_t.append(timed(mapping, tokens, calls))
            b, lo = statistics.median(base_t), statistics.median(lora_t)
            mark = " (engine's pick)" if (mapping is dense) == (picked.dense is not None) else ""
            print(f"| {step} | {tokens} | {label}{mark} | {b * 1e3:.2f} ms | {lo * 1e3:.2f} ms | {b / lo:.2f}x |")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
