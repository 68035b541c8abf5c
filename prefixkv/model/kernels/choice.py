"""Which native CPU kernels run, chosen by timing each against the PyTorch path on this machine.

A native kernel proven correct is not yet proven fast: the same source built for another CPU can
lose to PyTorch (the float32 prefill attention built for AVX2 ran 7-15x slower than SDPA on an AMD
Zen 3 before its AVX2 loops were written). So at a model's first load on a machine each kernel is
timed against the path the engine takes without it, on that model's shapes and dtype, and the
faster runs (`ops.KernelChoice`):

- prefill attention at 128, 512 and 2,048 new tokens against SDPA over contiguous K/V (what a
  prompt without cached context runs without it): the native kernel takes prompts and chunks up
  to the longest length it won at, and all of them where it won at every length;
- decode attention (batch 1 and 8, 512 tokens of context) against the gather + padded SDPA;
- the small-batch linear (1, 2, 4, 8 and 16 rows of the gate/up product) against the faster of
  oneDNN's packed kernel and F.linear: it takes steps up to the most rows it won at (and so does
  the one-call decode step, built of it);
- the many-row linear (a prefill's 256 rows of the gate/up and down products) against oneDNN's packed
  kernel: where it is at least as fast, every matmul keeps one copy of its weights, in the
  small-batch layout, for prefill and decode alike (layers.NativeLinear), instead of a second,
  oneDNN's, for prefills; where it is within the tolerance, only where the second copy would not
  fit (a prefill a few percent slower, not every decode step on oneDNN's slower streaming);
- residual add + RMSNorm, SiLU x up, rotary and the K/V cache write at a decode step's rows and a
  prefill's, against their PyTorch formulations.

Each comparison runs on one thread, both paths alternated, and keeps each path's fastest time: a
neighbour (or one of our OpenMP threads descheduled at a barrier, which a multi-threaded call then
waits a whole time slice for) only ever adds time, and on a busy 2-vCPU machine it did so to every
repetition of a two-thread call, deciding comparisons at random; on one thread the fastest of a few
is the code's own speed. Both paths split their work over threads alike (heads, rows, column
slabs) - but for the small-batch linear, timed at the engine's thread count: F.linear (MKL) runs
a product of one or two rows on one thread whatever the count. On an AMD Zen 2 with two threads
(2,048 -> 22,528, float32) MKL took 9.3 ms at one row and 18.2 at two against the native kernel's
6.7 and 7.1, where on one thread MKL's 10.3 ms beat the native 11.0 at one row, which had switched
the native kernel off for every row count (bench/small_linear.py).

The answer is kept on disk (`cache_dir()/kernel-choice`, JSON) keyed by the kernel library (its
name covers source, flags, compiler, torch and the CPU's flags), the CPU's model name, the shapes
and dtype, so it is measured once per machine and model shape (~2-5 s). One log line says what
runs where and why; `describe` gives it again (`prefixkv kernels`).

PREFIXKV_KERNEL_CHOICE=native skips the timing and runs every kernel where it applies;
=native,-blocked_linear,-rotary (any of `NATIVE_KERNELS` after a minus) runs every one but those,
on the PyTorch path (the test suite runs a fixed set so that what a test exercises does not depend
on the machine's load); =measure re-times even where an answer is on disk.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from . import build, ops
from .kept_answers import answer_path, keep_answer, read_answer
from .reference import reference_rotary, reference_silu_and_mul

logger = logging.getLogger(__name__)

ENV_MODE = "PREFIXKV_KERNEL_CHOICE"
MODES = ("auto", "native", "measure")
# the kernels PREFIXKV_KERNEL_CHOICE=native,-name leaves to the PyTorch path, by name
NATIVE_KERNELS = (
    "prefill_attention",
    "decode_attention",
    "small_linear",
    "blocked_linear",
    "add_rms_norm",
    "silu_and_mul",
    "rotary",
    "write_kv",
)
PREFILL_LENGTHS = (128, 512, 2048)
SMALL_LINEAR_ROWS = (1, 2, 4, 8, 16)
# the native kernel is kept unless PyTorch is faster by more than this: timings on a busy 2-vCPU
# machine move a few percent run to run, and the native paths also save allocations and copies
# the isolated timing does not see
TOLERANCE = 1.05
FORMAT_VERSION = 4  # 2: blocked_linear, 3: blocked_linear_faster, 4: small_linear at the engine's threads


@dataclass(frozen=True)
class KernelShapes:
    """What of a model decides the kernels' speed."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str  # "float32" / "bfloat16"

    @staticmethod
    def of(config: ModelConfig, dtype: torch.dtype) -> KernelShapes:
        return KernelShapes(
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim or config.hidden_size // config.num_attention_heads,
            dtype=str(dtype).removeprefix("torch."),
        )


@dataclass
class Timed:
    """One comparison: milliseconds per call of the native kernel and of the PyTorch path."""

    what: str
    native_ms: float
    torch_ms: float

    @property
    def native_wins(self) -> bool:
        return self.native_ms <= self.torch_ms * TOLERANCE

    def line(self) -> str:
        winner = "native" if self.native_wins else "PyTorch"
        return f"{self.what}: native {self.native_ms:.3f} ms, PyTorch {self.torch_ms:.3f} ms -> {winner}"


_made: dict[KernelShapes, tuple[ops.KernelChoice, list[str]]] = {}


def mode() -> str:
    """auto, native or measure (PREFIXKV_KERNEL_CHOICE; `native_exclusions` reads what follows native)."""
    return _parsed()[0]


def native_exclusions() -> frozenset[str]:
    """The kernels PREFIXKV_KERNEL_CHOICE=native,-name,... leaves to the PyTorch path."""
    return _parsed()[1]


def _parsed() -> tuple[str, frozenset[str]]:
    value = os.environ.get(ENV_MODE, "auto") or "auto"
    chosen, *rest = [part.strip() for part in value.split(",")]
    names = [part.removeprefix("-") for part in rest]
    if (
        chosen not in MODES
        or (rest and chosen != "native")
        or any(not part.startswith("-") for part in rest)
        or any(name not in NATIVE_KERNELS for name in names)
    ):
        raise ValueError(
            f"{ENV_MODE}={value!r}: expected one of {', '.join(MODES)}, or native followed by kernels to "
            f"leave to PyTorch (native,-blocked_linear); kernels: {', '.join(NATIVE_KERNELS)}"
        )
    return chosen, frozenset(names)


def _without(names: frozenset[str]) -> ops.KernelChoice:
    """Every kernel native but `names`."""
    off = {name: False for name in names if name != "prefill_attention"}
    if "blocked_linear" in names:
        off["blocked_linear_faster"] = False
    return ops.KernelChoice(prefill_max_tokens=0 if "prefill_attention" in names else None, **off)


def warn_if_bfloat16_is_emulated(dtype: torch.dtype) -> bool:
    """Log once (a warning) where bfloat16 is asked for on an x86 CPU without bfloat16 arithmetic
    (no AVX512-BF16, no AMX): every product then widens to float32 and rounds back, slower than
    float32 itself (44-47 against 32-34 CPU-seconds for the demo's prefill on an AMD Zen 3).
    Returns whether it warned."""
    global _warned_bf16
    flags = set(build.cpu_flags().split())
    if dtype != torch.bfloat16 or _warned_bf16 or "avx2" not in flags or flags & {"avx512_bf16", "amx_bf16"}:
        return False
    _warned_bf16 = True
    logger.warning(
        "bfloat16 on this CPU (%s) has no bfloat16 arithmetic (no AVX512-BF16, no AMX): products widen to "
        "float32 and round back, typically slower than --dtype float32, which is also exact",
        build.cpu_model() or "unknown",
    )
    return True


_warned_bf16 = False


def choose(shapes: KernelShapes) -> ops.KernelChoice | None:
    """Time (or read from disk) which kernels run for a model of `shapes`, put the answer in force
    for its dtype (ops.set_choice) and return it; None where no native kernel runs here or
    PREFIXKV_KERNEL_CHOICE=native (then every applicable one runs; with kernels named after it,
    every one but those, and that choice is returned)."""
    dtype = getattr(torch, shapes.dtype)
    if not ops.available():
        return None
    if mode() == "native":
        excluded = native_exclusions()
        if not excluded:
            return None
        fixed = _without(excluded)
        ops.set_choice(dtype, fixed)
        return fixed
    if shapes not in _made:
        _made[shapes] = _stored_or_measured(shapes)
    made, _ = _made[shapes]
    ops.set_choice(dtype, made)
    return made


def describe(shapes: KernelShapes) -> list[str]:
    """The lines of the choice for `shapes` (made if need be)."""
    fixed = choose(shapes)
    found = _made.get(shapes)
    if found is None:
        if fixed is not None:
            return [f"{summary(fixed)} ({ENV_MODE}={os.environ.get(ENV_MODE)})"]
        reason = f"{ENV_MODE}=native" if mode() == "native" else "no native kernels here"
        return [f"every kernel's native path where it applies ({reason})"]
    return found[1]


def _file(shapes: KernelShapes) -> Path:
    """Where the answer for `shapes` on this machine is kept."""
    shape = json.dumps(asdict(shapes), sort_keys=True)
    return answer_path("kernel-choice", [str(FORMAT_VERSION), ops.library_name() or "", build.cpu_model(), shape])


def _stored_or_measured(shapes: KernelShapes) -> tuple[ops.KernelChoice, list[str]]:
    path = _file(shapes)
    if mode() != "measure":
        data = read_answer(path)
        try:
            if data is not None:
                made = ops.KernelChoice(**data["choice"])
                lines = [str(x) for x in data["lines"]]
                logger.info("CPU kernels (measured before, %s): %s", path.name, summary(made))
                return made, lines
        except (KeyError, TypeError):
            pass  # unreadable: measure
    logger.info(
        "timing the native CPU kernels against PyTorch on this model's shapes (%s, %s; once per "
        "machine, a few seconds)",
        shapes.dtype,
        f"{shapes.heads}/{shapes.kv_heads} heads of {shapes.head_dim}",
    )
    start = time.perf_counter()
    made, lines = measure(shapes)
    lines.insert(0, f"{build.arch()} build {ops.library_name()}, one thread, {build.cpu_model()}")
    logger.info("CPU kernels (timed in %.1f s): %s", time.perf_counter() - start, summary(made))
    for line in lines:
        logger.debug("  %s", line)
    keep_answer(path, {"choice": asdict(made), "lines": lines})
    return made, lines


def summary(made: ops.KernelChoice) -> str:
    caps = ("prefill_max_tokens", "small_linear_max_rows", "blocked_linear_faster")
    native = [name for name, on in asdict(made).items() if name not in caps and on]
    torch_path = [name for name, on in asdict(made).items() if name not in caps and not on]
    if made.blocked_linear:
        where = "one layout" if made.blocked_linear_faster else "one layout where two do not fit"
        native[native.index("blocked_linear")] = f"blocked_linear ({where})"
    cap = made.prefill_max_tokens
    prefill = "any length" if cap is None else "none" if cap == 0 else f"up to {cap} new tokens"
    rows = made.small_linear_max_rows
    if made.small_linear and rows is not None:
        native[native.index("small_linear")] = f"small_linear (up to {rows} rows)"
    return (
        f"native prefill attention for {prefill}; native: {', '.join(native) or 'none'}; "
        f"PyTorch: {', '.join(torch_path) or 'none'}"
    )


def _time(native: Callable[[], object], reference: Callable[[], object], what: str, reps: int = 7) -> Timed:
    """Both paths alternated, the fastest of `reps` each: a neighbour's burst (or one of our OpenMP
    threads descheduled at a barrier) only ever adds time, so the minimum is each path's own speed.
    A loss of the native path is timed once more before it counts (the fastest of both rounds): on
    a noisy 2-vCPU VM one round once had the small-batch linear lose at 1 row (0.41 against 0.20 ms,
    where it won 0.16 against 0.22 in the next runs), which switched it off for every decode step
    and tripled the default model's step time."""
    native()
    reference()
    a: list[float] = []
    b: list[float] = []
    for _round in range(2):
        for _ in range(reps):
            t = time.perf_counter()
            native()
            a.append(time.perf_counter() - t)
            t = time.perf_counter()
            reference()
            b.append(time.perf_counter() - t)
        timed = Timed(what, min(a) * 1e3, min(b) * 1e3)
        if timed.native_wins:
            break
    return timed


def measure(shapes: KernelShapes) -> tuple[ops.KernelChoice, list[str]]:
    """Time every kernel that applies to `shapes` against its PyTorch path (see the module's
    docstring); the choice and one line per comparison."""
    dtype = getattr(torch, shapes.dtype)
    before, threads = ops.choice(dtype), torch.get_num_threads()
    ops.set_choice(dtype, None)  # every kernel callable while timing
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        timed: dict[str, list[Timed]] = {}
        attention = shapes.head_dim in ops.HEAD_DIMS and (
            shapes.heads % shapes.kv_heads == 0 and shapes.heads // shapes.kv_heads <= ops.MAX_GROUP
        )
        if attention:
            timed["prefill"] = [_prefill(shapes, dtype, n, g) for n in PREFILL_LENGTHS]
            timed["decode_attention"] = [_decode_attention(shapes, dtype, b, g) for b in (1, 8)]
        if ops.small_linear_available(dtype):
            torch.set_num_threads(threads)  # (see the module's docstring: MKL's few-row product runs on one)
            try:
                timed["small_linear"] = [_small_linear(shapes, dtype, m, g) for m in SMALL_LINEAR_ROWS]
            finally:
                torch.set_num_threads(1)
        if ops.blocked_linear_available(dtype):
            timed["blocked_linear"] = [_blocked_linear(shapes, dtype, product, g) for product in ("gate_up", "down")]
        timed["add_rms_norm"] = [_norm(shapes, dtype, rows, g) for rows in (1, 256)]
        timed["silu_and_mul"] = [_silu(shapes, dtype, rows, g) for rows in (1, 256)]
        if attention:
            timed["rotary"] = [_rotary(shapes, dtype, rows, g) for rows in (1, 256)]
            timed["write_kv"] = [_write_kv(shapes, dtype, rows, g) for rows in (1, 256)]
    finally:
        ops.set_choice(dtype, before)
        torch.set_num_threads(threads)

    def wins(name: str, tolerance: float = TOLERANCE) -> bool:  # where it applies: the sum over the sizes timed
        runs = timed.get(name)
        return not runs or sum(t.native_ms for t in runs) <= tolerance * sum(t.torch_ms for t in runs)

    prefill_cap = _cap(timed.get("prefill"), PREFILL_LENGTHS)
    rows_cap = _cap(timed.get("small_linear"), SMALL_LINEAR_ROWS)
    made = ops.KernelChoice(
        prefill_max_tokens=prefill_cap,
        small_linear_max_rows=rows_cap,
        decode_attention=wins("decode_attention"),
        small_linear="small_linear" in timed and rows_cap != 0,
        blocked_linear="blocked_linear" in timed and rows_cap != 0 and wins("blocked_linear"),
        blocked_linear_faster="blocked_linear" in timed and rows_cap != 0 and wins("blocked_linear", 1.0),
        add_rms_norm=wins("add_rms_norm"),
        silu_and_mul=wins("silu_and_mul"),
        rotary=wins("rotary"),
        write_kv=wins("write_kv"),
    )
    return made, [t.line() for runs in timed.values() for t in runs]


def _cap(runs: list[Timed] | None, sizes: tuple[int, ...]) -> int | None:
    """None where the native path won at every size (or was not timed), else the largest size it
    won at whose sizes up to it it won in sum; 0 where it lost at the smallest. A loss between two
    wins is taken for noise: one at 2 rows of the small-batch linear, between wins at 1, 4, 8 and 16
    (a neighbour's burst that outlived both rounds of `_time`), once capped it at 1 row."""
    if not runs or all(t.native_wins for t in runs):
        return None
    if not runs[0].native_wins:
        return 0
    for k in range(len(runs) - 1, 0, -1):
        native = sum(t.native_ms for t in runs[: k + 1])
        reference = sum(t.torch_ms for t in runs[: k + 1])
        if runs[k].native_wins and native <= TOLERANCE * reference:
            return sizes[k]
    return sizes[0]


def _prefill(shapes: KernelShapes, dtype: torch.dtype, n: int, g: torch.Generator) -> Timed:
    Hq, Hkv, D = shapes.heads, shapes.kv_heads, shapes.head_dim
    q = torch.randn(n, Hq, D, generator=g).to(dtype)
    k = torch.randn(n, Hkv, D, generator=g).to(dtype)
    v = torch.randn(n, Hkv, D, generator=g).to(dtype)
    slots = torch.arange(n)
    seqs = torch.tensor([[0, n, n, 0]])
    out = torch.empty_like(q)
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    gqa = Hq != Hkv

    def native() -> None:
        ops.prefill_attention(q, k, v, seqs, slots, D**-0.5, out)

    def reference() -> None:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=D**-0.5, enable_gqa=gqa)
        out.copy_(o[0].transpose(0, 1))

    return _time(native, reference, f"prefill attention, {n} tokens", reps=3 if n >= 2048 else 7)


def _decode_attention(shapes: KernelShapes, dtype: torch.dtype, batch: int, g: torch.Generator) -> Timed:
    Hq, Hkv, D, L = shapes.heads, shapes.kv_heads, shapes.head_dim, 512
    q = torch.randn(batch, Hq, D, generator=g).to(dtype)
    k = torch.randn(batch * L + 16, Hkv, D, generator=g).to(dtype)
    v = torch.randn(batch * L + 16, Hkv, D, generator=g).to(dtype)
    slots = torch.randperm(batch * L + 16, generator=g)[: batch * L].view(batch, L)
    lens = torch.full((batch,), L)

    def native() -> None:
        ops.decode_attention(q, k, v, slots, lens, D**-0.5)

    def reference() -> None:  # attention.paged_attention's path without the kernel
        kc = k.index_select(0, slots.reshape(-1)).view(batch, L, Hkv, D).transpose(1, 2)
        vc = v.index_select(0, slots.reshape(-1)).view(batch, L, Hkv, D).transpose(1, 2)
        F.scaled_dot_product_attention(q.view(batch, Hkv, Hq // Hkv, D), kc, vc, scale=D**-0.5)

    return _time(native, reference, f"decode attention, batch {batch} x {L} tokens")


def _small_linear(shapes: KernelShapes, dtype: torch.dtype, rows: int, g: torch.Generator) -> Timed:
    weight = (torch.randn(2 * shapes.intermediate, shapes.hidden, generator=g) * 0.02).to(dtype)
    x = torch.randn(rows, shapes.hidden, generator=g).to(dtype)
    small = ops.small_linear_weight(weight)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
    N = weight.shape[0]

    def native() -> None:
        assert small is not None
        ops.small_linear(x, small, N)

    def onednn() -> None:
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    def mkl() -> None:
        F.linear(x, weight)

    first = _time(native, onednn, f"small linear, {rows} rows x {shapes.hidden} -> {N}")
    if dtype == torch.float32:  # DualLayoutLinear takes F.linear at few rows where the kernel is not chosen
        other = _time(native, mkl, "")
        first.torch_ms = min(first.torch_ms, other.torch_ms)
    return first


BLOCKED_LINEAR_ROWS = 256


def _blocked_linear(shapes: KernelShapes, dtype: torch.dtype, product: str, g: torch.Generator) -> Timed:
    H, I = shapes.hidden, shapes.intermediate
    N, K = (2 * I, H) if product == "gate_up" else (H, I)
    weight = (torch.randn(N, K, generator=g) * 0.02).to(dtype)
    x = torch.randn(BLOCKED_LINEAR_ROWS, K, generator=g).to(dtype)
    native_weight = ops.small_linear_weight(weight)
    # without oneDNN the models' matmuls are F.linear / torch.mm
    onednn = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8) if onednn else weight

    def native() -> None:
        assert native_weight is not None
        ops.blocked_linear(x, native_weight, N)

    def reference() -> None:
        if onednn:
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        else:
            F.linear(x, weight)

    big = BLOCKED_LINEAR_ROWS * N * K > 2e9  # a 1B model's products: ~0.1-0.2 s a call on one thread
    return _time(native, reference, f"many-row linear, {BLOCKED_LINEAR_ROWS} rows x {K} -> {N}", reps=3 if big else 7)


def _norm(shapes: KernelShapes, dtype: torch.dtype, rows: int, g: torch.Generator) -> Timed:
    h = torch.randn(rows, shapes.hidden, generator=g).to(dtype)
    delta = (torch.randn(rows, shapes.hidden, generator=g) * 1e-3).to(dtype)
    weight = torch.ones(shapes.hidden, dtype=dtype)

    def native() -> None:
        ops.add_rms_norm(h, delta, weight, 1e-5)

    def reference() -> None:  # layers.RMSNorm.add_and_norm without the kernel
        s = h + delta
        if dtype == torch.float32:
            F.rms_norm(s, (shapes.hidden,), weight, 1e-5)
        else:
            weight * F.rms_norm(s.float(), (shapes.hidden,), None, 1e-5).to(dtype)

    return _time(native, reference, f"add + RMSNorm, {rows} rows")


def _silu(shapes: KernelShapes, dtype: torch.dtype, rows: int, g: torch.Generator) -> Timed:
    gate_up = torch.randn(rows, 2 * shapes.intermediate, generator=g).to(dtype)

    def native() -> None:
        ops.silu_and_mul(gate_up)

    def reference() -> None:
        reference_silu_and_mul(gate_up)

    return _time(native, reference, f"SiLU x up, {rows} rows")


def _rotary(shapes: KernelShapes, dtype: torch.dtype, rows: int, g: torch.Generator) -> Timed:
    D = shapes.head_dim
    x = torch.randn(rows, shapes.heads, D, generator=g).to(dtype)
    angles = torch.rand(rows, D // 2, generator=g)
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
    sin = torch.cat((-angles.sin(), angles.sin()), -1).to(dtype)

    def native() -> None:
        ops.rotary_(x, cos, sin)

    def reference() -> None:
        reference_rotary(x, cos, sin)

    return _time(native, reference, f"rotary, {rows} rows")


def _write_kv(shapes: KernelShapes, dtype: torch.dtype, rows: int, g: torch.Generator) -> Timed:
    Hkv, D = shapes.kv_heads, shapes.head_dim
    qkv = torch.randn(rows, (shapes.heads + 2 * Hkv) * D, generator=g).to(dtype)
    k = qkv[:, shapes.heads * D : (shapes.heads + Hkv) * D].view(rows, Hkv, D)
    v = qkv[:, (shapes.heads + Hkv) * D :].view(rows, Hkv, D)
    k_flat = torch.zeros(4 * rows + 64, Hkv, D, dtype=dtype)
    v_flat = torch.zeros_like(k_flat)
    slots = torch.randperm(k_flat.shape[0], generator=g)[:rows]

    def native() -> None:
        ops.write_kv(k, v, k_flat, v_flat, slots)

    def reference() -> None:
        k_flat.index_copy_(0, slots, k)
        v_flat.index_copy_(0, slots, v)

    return _time(native, reference, f"K/V cache write, {rows} rows")
