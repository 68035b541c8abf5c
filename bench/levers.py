"""What each CPU lever of issue 16 buys, one kernel at a time: the form the engine uses against the
one it replaced (or a rejected alternative), on the default model's shapes, alternated in one run.

    .venv/bin/python bench/levers.py [--threads 1] [--only linear,rotary,gather,decode]

- linear: the four layer matmuls of one decode/prefill step summed, and the LM head, at M rows:
  F.linear on the [out, in] weight (before), torch.mm on the weight stored transposed
  (TransposedLinear, the float32 fallback where torch has no oneDNN) and oneDNN-packed (PackedLinear,
  what a model too large for a second layout runs; docs/benchmarks.md "Model shapes users serve").
- rotary: q and k rotated apart, half by half (seven operations each, before), against
  RotaryEmbedding.apply over both at once (four operations); bit for bit the same values.
- gather: a decode step's K (or V) gathered through the block table by advanced indexing (before)
  and by index_select on the flattened slots (paged attention's _gather); the same rows.
- decode: a whole decode step of the default model at batch 8 with either gather.

With one thread (the default) each figure is this process's CPU time, the steadiest measure on a
shared machine; with more, wall time. Prints the minimum and the median over repeats.
"""

# ruff: noqa: B023  (every closure below is timed within the loop iteration that builds it)
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

LAYER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out): qkv, o, gate_up, down


def timer(fn: Callable[[], object], reps: int = 7, min_seconds: float = 0.03) -> tuple[float, float]:
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    fn()
    start, n = clock(), 0
    while clock() - start < min_seconds:
        fn()
        n += 1
    runs = []
    for _ in range(reps):
        start = clock()
        for _ in range(n):
            fn()
        runs.append((clock() - start) / n)
    return min(runs), statistics.median(runs)


def show(label: str, results: dict[str, tuple[float, float]]) -> None:
    base = next(iter(results.values()))[0]
    cells = [
        f"{name} {lo * 1e6:8.1f} us (median {med * 1e6:8.1f}, x{base / lo:.2f})" for name, (lo, med) in results.items()
    ]
    print(f"{label}: " + " | ".join(cells), flush=True)


def lever_linear() -> None:
    from prefixkv.model.layers import PackedLinear, TransposedLinear, packed_linear_works

    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(out, inp, generator=g) for inp, out in LAYER_SHAPES]
    kinds: dict[str, Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]] = {
        "F.linear": lambda w: lambda x: F.linear(x, w),
        "transposed": TransposedLinear,
    }
    if packed_linear_works(torch.float32):
        kinds["oneDNN-packed"] = PackedLinear
    layers = {name: [make(w) for w in weights] for name, make in kinds.items()}
    head_w = torch.randn(49152, 576, generator=g)
    heads = {name: make(head_w) for name, make in kinds.items()}
    print("float32 linear, x min time (x = speed-up over F.linear):")
    for m in (1, 2, 4, 8, 16, 32, 128, 480):
        xs = [torch.randn(m, inp, generator=g) for inp, _ in LAYER_SHAPES]
        res = {}
        for name, fns in layers.items():
            res[name] = timer(lambda fns=fns: [f(x) for f, x in zip(fns, xs)])
        show(f"  {m:3d} rows, 4 layer matmuls", res)
        x = torch.randn(m, 576, generator=g)
        show(f"  {m:3d} rows, LM head        ", {name: timer(lambda h=h: h(x), reps=3) for name, h in heads.items()})


def lever_rotary() -> None:
    from prefixkv.model import load_model
    from prefixkv.model.layers import RotaryEmbedding

    cfg = load_model(None).config
    rope = RotaryEmbedding(cfg, torch.float32, "cpu")
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    half = d // 2

    def apart(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    print("rotary, one layer (q and k of T tokens):")
    for t in (1, 8, 480):
        qkv = torch.randn(t, (hq + 2 * hkv) * d)
        pos = torch.arange(t) + 100
        cos, sin = rope.cos_sin(pos)
        freqs = torch.outer(pos.float(), rope.inv_freq)
        c, s = freqs.cos()[:, None], freqs.sin()[:, None]
        q = qkv[:, : hq * d].view(t, hq, d)
        k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
        both = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)
        before, after = apart(q, c, s), RotaryEmbedding.apply(both, cos, sin)
        assert torch.equal(torch.cat((before, apart(k, c, s)), 1), after), "rotations differ"
        show(
            f"  T={t:3d}",
            {
                "apart": timer(lambda: (apart(q, c, s), apart(k, c, s))),
                "together": timer(lambda: RotaryEmbedding.apply(both, cos, sin)),
            },
        )


def lever_gather() -> None:
    from prefixkv.model.attention import _gather

    print("K gather of one decode step, one layer:")
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        flat = torch.randn(4096 * 16, 3, 64, generator=g).to(dtype)
        for b, length in ((1, 272), (8, 272), (8, 1650)):
            slots = torch.randint(0, flat.shape[0], (b, length), generator=g)
            assert torch.equal(flat[slots], _gather(flat, slots))
            show(
                f"  {str(dtype).removeprefix('torch.'):8s} batch {b} context {length:4d}",
                {"advanced indexing": timer(lambda: flat[slots]), "index_select": timer(lambda: _gather(flat, slots))},
            )


def lever_decode() -> None:
    import prefixkv.model.attention as attention
    from prefixkv.memory.block_tensors import allocate_kv_cache
    from prefixkv.model import AttentionMetadata, load_model

    gathers = {"index_select": attention._gather, "advanced indexing": lambda flat, slots: flat[slots]}
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    for dtype in (torch.float32, torch.bfloat16):
        lm = load_model(None, dtype=dtype)
        model, cfg = lm.model, lm.config
        model.pack_for_cpu()
        batch, context, bs = 8, 256, 16
        per = (context + 64) // bs + 1
        caches = allocate_kv_cache(cfg, batch * per + 4, bs, dtype=dtype)
        tables = torch.randperm(batch * per, generator=torch.Generator().manual_seed(0)).view(batch, per)

        def meta(lens: list[int], new: int) -> AttentionMetadata:
            slots, qsl = [], [0]
            for b in range(batch):
                slots += [int(tables[b, p // bs]) * bs + p % bs for p in range(lens[b] - new, lens[b])]
                qsl.append(qsl[-1] + new)
            return AttentionMetadata(torch.tensor(slots), qsl, lens, tables)

        times: dict[str, list[float]] = {name: [] for name in gathers}
        try:
            with torch.inference_mode():
                ids = torch.randint(100, cfg.vocab_size, (batch * context,))
                model(ids, torch.arange(context).repeat(batch), caches, meta([context] * batch, context))
                lens, nxt = [context] * batch, ids[:batch]
                for _ in range(24):  # alternate the two, a step each
                    for name, fn in gathers.items():
                        attention._gather = fn
                        m, pos = meta([x + 1 for x in lens], 1), torch.tensor(lens)
                        start = clock()
                        model.compute_logits(model(nxt, pos, caches, m))
                        times[name].append(clock() - start)
                    lens = [x + 1 for x in lens]
        finally:
            attention._gather = gathers["index_select"]
        cells = [
            f"{name} median {statistics.median(v[2:]) * 1e3:.1f} ms (min {min(v) * 1e3:.1f})"
            for name, v in times.items()
        ]
        print(
            f"decode step, batch 8, context ~{context + 12}, {str(dtype).removeprefix('torch.')}: " + " | ".join(cells)
        )


LEVERS = {"linear": lever_linear, "rotary": lever_rotary, "gather": lever_gather, "decode": lever_decode}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU time, steady on a shared machine)")
    ap.add_argument("--only", default=",".join(LEVERS), help=f"comma-separated, of: {', '.join(LEVERS)}")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    chosen = args.only.split(",")
    for name in chosen:
        if name not in LEVERS:
            sys.exit(f"unknown lever {name!r}; choose from {', '.join(LEVERS)}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}")
    for name in chosen:
        LEVERS[name]()
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
