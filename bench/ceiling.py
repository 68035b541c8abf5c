"""This machine's ceiling, measured: GEMM FLOP/s per dtype and memory bandwidth, and the work a
decoder forward does (FLOPs of a prefill, bytes a decode step reads), so that a model benchmark can
print the fraction of the ceiling it reaches. Used by bench/roofline.py (which prints the ceiling
alone) and by the model benchmarks (bench/model_speed.py, bench/shared_prefix.py, bench/step_times.py;
bench/seed_scenario.py for its cold question).

Every figure is a median over repeats of the same operation, timed in this process with torch's
current thread count, so it moves with the machine's load like the benchmark that quotes it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

#: tokens x in-features x out-features of the default model's (SmolLM2-135M) prefill matmuls at
#: 1,024 tokens: fused q/k/v, o, fused gate/up, down - plus one large square product
PREFILL_SHAPES: dict[str, tuple[int, int, int]] = {
    "qkv 1024x576x960": (1024, 576, 960),
    "o 1024x576x576": (1024, 576, 576),
    "gate_up 1024x576x3072": (1024, 576, 3072),
    "down 1024x1536x576": (1024, 1536, 576),
}
SQUARE = 2048
BANDWIDTH_BYTES = 1 << 30  # past the 480 MiB last-level cache this VM reports


def _median_seconds(fn: Callable[[], object], reps: int, min_seconds: float = 0.05) -> float:
    """Median over `reps` timings of fn, each timing looping fn until `min_seconds` passed."""
    fn()  # warm-up (first-call allocation, oneDNN primitive creation)
    t = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t, 1e-7)
    inner = max(1, int(min_seconds / once))
    runs = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        runs.append((time.perf_counter() - t) / inner)
    return statistics.median(runs)


def gemm_flops(m: int, k: int, n: int, dtype: torch.dtype, reps: int = 5) -> float:
    """FLOP/s of y = x @ W.T with x [m, k] and W [n, k]: the faster of F.linear and oneDNN's kernel
    on the weight packed once (how both engines' CPU products run: prefixkv's PackedLinear and
    DualLayoutLinear, vLLM's onednn_mm), which beats F.linear by a few percent in float32 - a
    ceiling measured with F.linear alone was exceeded by the models' own prefills."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    best = _median_seconds(lambda: F.linear(x, w), reps)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
        best = min(
            best, _median_seconds(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), reps)
        )
    except (RuntimeError, AttributeError):  # no oneDNN in this torch build, or no kernel for the CPU
        pass
    return 2 * m * k * n / best


def square_flops(size: int, dtype: torch.dtype, reps: int = 3) -> float:
    """FLOP/s of torch.mm on two size x size matrices."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g).to(dtype)
    b = torch.randn(size, size, generator=g).to(dtype)
    out = torch.empty(size, size, dtype=dtype)
    return 2 * size**3 / _median_seconds(lambda: torch.mm(a, b, out=out), reps)


def bandwidth(nbytes: int = BANDWIDTH_BYTES, reps: int = 5) -> tuple[float, float]:
    """(read, copy) bytes/s over a buffer far larger than the caches: a sum reads it once; a copy
    reads it and writes another (counted as 2 x nbytes moved)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    read = nbytes / _median_seconds(lambda: src.sum(), reps, min_seconds=0.2)
    copy = 2 * nbytes / _median_seconds(lambda: dst.copy_(src), reps, min_seconds=0.2)
    return read, copy


@dataclass
class Ceiling:
    """Measured peaks: FLOP/s per dtype name (the best of the prefill shapes and the square) and
    bytes/s (the faster of read and copy)."""

    flops: dict[str, float] = field(default_factory=dict)
    shape_flops: dict[str, dict[str, float]] = field(default_factory=dict)
    read_bytes_per_s: float = 0.0
    copy_bytes_per_s: float = 0.0

    @property
    def bytes_per_s(self) -> float:
        return max(self.read_bytes_per_s, self.copy_bytes_per_s)

    def flops_of(self, dtype: torch.dtype) -> float:
        return self.flops[str(dtype).removeprefix("torch.")]

    def lines(self) -> list[str]:
        out = []
        for name, shapes in self.shape_flops.items():
            cells = ", ".join(f"{s} {v / 1e9:.0f}" for s, v in shapes.items())
            out.append(f"GEMM {name:8s} GFLOP/s: {cells}; ceiling {self.flops[name] / 1e9:.0f}")
        out.append(
            f"memory GB/s: read {self.read_bytes_per_s / 1e9:.1f}, copy {self.copy_bytes_per_s / 1e9:.1f} "
            f"(read + write); ceiling {self.bytes_per_s / 1e9:.1f}"
        )
        return out


def measure(dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16), quick: bool = False) -> Ceiling:
    """Measure the ceiling in this process. `quick`: fewer repeats (what a model benchmark runs
    before its own phases, a few seconds)."""
    reps = 3 if quick else 5
    c = Ceiling()
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        shapes = {label: gemm_flops(*mnk, dtype, reps) for label, mnk in PREFILL_SHAPES.items()}
        shapes[f"square {SQUARE}"] = square_flops(SQUARE, dtype, 2 if quick else 3)
        c.shape_flops[name] = shapes
        c.flops[name] = max(shapes.values())
    c.read_bytes_per_s, c.copy_bytes_per_s = bandwidth(reps=reps)
    return c


def measure_cuda(dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,), device: str = "cuda") -> Ceiling:
    """The same ceiling on a CUDA device: FLOP/s of an 8192-square product per dtype (the size at
    which an H100/H200 reaches its peak; the default model's own shapes are far too small to) and
    bytes/s of a 4 GiB device-to-device copy (read + write) - each timed with the device
    synchronised, medians of 5 after a warm-up."""

    def seconds(fn: Callable[[], object], inner: int) -> float:
        fn()
        torch.cuda.synchronize(device)
        runs = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(inner):
                fn()
            torch.cuda.synchronize(device)
            runs.append((time.perf_counter() - t) / inner)
        return statistics.median(runs)

    c = Ceiling()
    n = 8192
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        out = torch.empty(n, n, dtype=dtype, device=device)
        flops = 2 * n**3 / seconds(lambda a=a, b=b, out=out: torch.mm(a, b, out=out), 10)
        c.shape_flops[name] = {f"square {n}": flops}
        c.flops[name] = flops

    def bandwidth_on_device() -> tuple[float, float]:
        src = torch.ones(1 << 30, dtype=torch.float32, device=device)  # 4 GiB, far past the L2
        dst = torch.empty_like(src)
        nbytes = src.numel() * src.element_size()
        return nbytes / seconds(lambda: src.sum(), 10), 2 * nbytes / seconds(lambda: dst.copy_(src), 10)

    c.read_bytes_per_s, c.copy_bytes_per_s = bandwidth_on_device()
    torch.cuda.empty_cache()
    return c


# -- the work of a forward ----------------------------------------------------------------------
def linear_params(config) -> int:
    """Weights multiplied per token by every decoder layer together (the LM head excluded)."""
    h, i = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    return config.num_hidden_layers * (h * (q + 2 * kv) + q * h + 3 * h * i)


def prefill_flops(config, tokens: int, cached: int = 0, logits_rows: int = 1) -> float:
    """FLOPs of computing `tokens` new positions after `cached` ones: 2 x params per token for the
    linear layers, causal attention (QK^T and PV, 2 x 2 x heads x head_dim per visible pair), and
    the LM head for `logits_rows` rows."""
    pairs = tokens * cached + tokens * (tokens + 1) // 2  # (query, key) pairs a causal prefill scores
    attention = 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * pairs
    head = 2 * logits_rows * config.hidden_size * config.vocab_size
    return 2 * linear_params(config) * tokens + attention + head


def decode_bytes(config, dtype: torch.dtype, batch: int, context: int) -> float:
    """Bytes one decode step must read at least: every linear weight and the LM head once, and
    each sequence's K and V over `context` positions in every layer."""
    size = torch.empty((), dtype=dtype).element_size()
    weights = linear_params(config) + config.hidden_size * config.vocab_size
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * batch * context
    return (weights + kv) * size


def fraction(achieved: float, peak: float) -> str:
    return f"{100 * achieved / peak:.0f}% of the measured ceiling"
