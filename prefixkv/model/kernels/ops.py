"""Native CPU kernels, built on first use with the system C++ compiler and called through ctypes.

- paged decode attention (csrc/decode_attention.cpp): reads each sequence's K and V in place
  through its slots, where the PyTorch path first gathers a copy of the whole context
  (index_select) and then runs SDPA over it - at batch 16 with 512 tokens of context that copy and
  the second read were ~37% of a float32 decode step (docs/benchmarks.md);
- residual add + RMSNorm (csrc/add_rms_norm.cpp): one pass per row where eager PyTorch runs ~8
  operators per norm;
- causal prefill attention (csrc/prefill_attention.cpp), SiLU x up, the rotary embedding in place,
  a step's K and V into the paged cache (csrc/write_kv.cpp: two row copies per token, where
  index_copy_ from the strided qkv views ran at ~2 GB/s);
- the small-batch linear (csrc/small_linear.cpp): a decode step's 1-16 rows times a weight laid out
  once in 64-byte column blocks, streamed once per step (float32 with AVX-512 or AVX2 + FMA,
  bfloat16 with AVX512-BF16), where oneDNN's kernels, built for many rows, read the weights at half
  the speed;
- the many-row linear (csrc/blocked_linear.cpp): a prefill's rows times the same layout, a blocked
  matrix product within 3-11% of oneDNN's speed at a prefill's rows (AMD Zen 4) whose every row is the
  small-batch linear's bit for bit, so one copy of the weights serves prefill and decode;
- every layer of a small decode step in one call (csrc/decode_layers.cpp): the pieces above,
  each the very function its own kernel runs (csrc/kernels.h), inside one OpenMP region - no
  Python, new tensor or thread start-up between them; bit for bit the layer-by-layer results.

The source is compiled once per machine (~9 s for all files on the 2-vCPU Zen 4) into a cache folder
(``$PREFIXKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/prefixkv`` or ``~/.cache/prefixkv``), keyed by the
source, the flags, the compiler, torch's version and the CPU's flags; concurrent processes write
it atomically (build.py). The library links the OpenMP runtime torch has already loaded, so its threads are
torch's threads. Before first use it is checked against the PyTorch path on small cases (self_check.py);
the ctypes calls themselves are in calls.py.

Where anything is missing - no compiler, not Linux, no OpenMP in torch, a failed build or check -
the PyTorch path runs, with one log line saying why. ``PREFIXKV_CPU_KERNELS=0`` turns the kernels
off (the PyTorch path runs everywhere); `disabled()` does so for a block of code (tests, benches).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from . import calls, self_check
from .calls import DTYPE_CODES
from .calls import HEAD_DIMS as HEAD_DIMS  # what the attention kernels take, asked by the model
from .calls import MAX_GROUP as MAX_GROUP
from .library import CpuKernels, load

logger = logging.getLogger(__name__)
ENV_SWITCH = "PREFIXKV_CPU_KERNELS"
_enabled = os.environ.get(ENV_SWITCH, "1") != "0"
DTYPE_BITS = {torch.float32: 1, torch.bfloat16: 2}  # the linear kernels' *_available() bits
_lock = threading.Lock()
_loaded = False
_kernels: CpuKernels | None = None  # set once, by the first _kernels_or_none()
_library_name: str | None = None  # named even where the kernels failed their check
_load_failure: str | None = None  # why the library could not be built or loaded, where it could not


@dataclass(frozen=True)
class KernelChoice:
    """Which native kernels run for one dtype, as timed against the PyTorch path on this machine
    (kernels/choice.py). `prefill_max_tokens`: the longest prompt or chunk (new tokens) the
    native prefill attention takes (0: none; None: no limit but the dtype's default);
    `small_linear_max_rows`: the most rows the small-batch linear takes (and so the one-call decode
    step's batch; None: SMALL_LINEAR_MAX_ROWS)."""

    prefill_max_tokens: int | None = None
    small_linear_max_rows: int | None = None
    decode_attention: bool = True
    small_linear: bool = True
    blocked_linear: bool = True  # timed within the tolerance of oneDNN's speed
    blocked_linear_faster: bool = True  # and at least as fast
    add_rms_norm: bool = True
    silu_and_mul: bool = True
    rotary: bool = True
    write_kv: bool = True


# per dtype, set once a model's shapes were timed (kernel_choice.choose); absent: every kernel runs
_choices: dict[torch.dtype, KernelChoice] = {}


def set_choice(dtype: torch.dtype, choice: KernelChoice | None) -> None:
    """Run the kernels `choice` names for `dtype` from now on (None: all of them again)."""
    if choice is None:
        _choices.pop(dtype, None)
    else:
        _choices[dtype] = choice


def choice(dtype: torch.dtype) -> KernelChoice | None:
    """The choice in force for `dtype`, if one was made."""
    return _choices.get(dtype)


def _chosen(name: str, dtype: torch.dtype) -> bool:
    made = _choices.get(dtype)
    return made is None or bool(getattr(made, name))


def library_name() -> str | None:
    """The file name of the loaded kernel library (its key names source, flags, compiler, torch and
    CPU), or None where no kernels are loaded."""
    _kernels_or_none()
    return _library_name


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the block with the PyTorch path (the kernels stay built)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def enabled() -> bool:
    """Whether native kernels may run (not switched off by PREFIXKV_CPU_KERNELS=0 or `disabled()`)."""
    return _enabled


def load_failure() -> str | None:
    """Why the kernels' library could not be built or loaded (the reason their log line gave), or
    None: loaded, or not tried yet (this does not try)."""
    return _load_failure


def _kernels_or_none() -> CpuKernels | None:
    global _loaded, _kernels, _library_name, _load_failure
    if _loaded:
        return _kernels
    with _lock:
        if not _loaded:
            _load_failure = None
            try:
                lib, _library_name = load()
                if self_check.kernels_agree(
                    lib.prefixkv_decode_attention,
                    lib.prefixkv_add_rms_norm,
                    lib.prefixkv_prefill_attention,
                    lib.prefixkv_silu_and_mul,
                    lib.prefixkv_rotary,
                ):
                    kernels = CpuKernels(
                        decode_attention=lib.prefixkv_decode_attention,
                        add_rms_norm=lib.prefixkv_add_rms_norm,
                        prefill_attention=lib.prefixkv_prefill_attention,
                        prefill_unit=int(lib.prefixkv_prefill_attention_unit()),
                        silu_and_mul=lib.prefixkv_silu_and_mul,
                        rotary=lib.prefixkv_rotary,
                        write_kv=lib.prefixkv_write_kv,
                    )
                    built = lib.prefixkv_small_linear_available()
                    dtypes = [dt for dt, bit in DTYPE_BITS.items() if built & bit]
                    agree = [dt for dt in dtypes if self_check.small_linear_agrees(lib.prefixkv_small_linear, dt)]
                    if agree == dtypes:  # possibly none: then small_linear_available() is False throughout
                        kernels = dataclasses.replace(
                            kernels,
                            small_linear=lib.prefixkv_small_linear,
                            small_linear_dtypes=frozenset(agree),
                            decode_layers=lib.prefixkv_decode_layers,
                        )
                        many = lib.prefixkv_blocked_linear_available()
                        built_many = [dt for dt in agree if many & DTYPE_BITS[dt]]
                        small, blocked_fn = lib.prefixkv_small_linear, lib.prefixkv_blocked_linear
                        blocked = [dt for dt in built_many if self_check.blocked_linear_agrees(blocked_fn, small, dt)]
                        if blocked:
                            kernels = dataclasses.replace(
                                kernels, blocked_linear=blocked_fn, blocked_linear_dtypes=frozenset(blocked)
                            )
                        if blocked != built_many:
                            logger.warning("the many-row linear kernel disagreed with the small-batch one; not used")
                    else:
                        logger.warning("the small-batch linear kernel disagreed with F.linear; not used")
                    _kernels = kernels
                else:
                    logger.warning("CPU kernels disagreed with the PyTorch path; not used")
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _load_failure = str(e)
                logger.info("CPU kernels not used (%s); the PyTorch path runs", e)
            _loaded = True
    return _kernels


def available() -> bool:
    """Whether the native kernels are built, checked and switched on here (builds them on the first
    call); which of them run for a dtype is `choice`'s to say."""
    return _enabled and _kernels_or_none() is not None


def decode_attention_available(dtype: torch.dtype) -> bool:
    """Whether decode attention of `dtype` runs the native kernel here."""
    return available() and _chosen("decode_attention", dtype)


def prefill_max_new_tokens(dtype: torch.dtype) -> int:
    """The most new tokens (a prompt, or a chunk after cached context) the native prefill attention
    takes for `dtype` here: the measured choice where one was made, else the dtype's default
    (bfloat16 by what the CPU multiplies on, BF16_PREFILL_MAX_NEW_TOKENS); 0 where it does not run."""
    if not available() or dtype not in DTYPE_CODES:
        return 0
    default = BF16_PREFILL_MAX_NEW_TOKENS[bf16_prefill_attention_unit()] if dtype == torch.bfloat16 else NO_LIMIT
    made = _choices.get(dtype)
    if made is None or made.prefill_max_tokens is None:
        return default
    return made.prefill_max_tokens


NO_LIMIT = 1 << 62
# bfloat16 prompts up to this many new tokens go to the native prefill kernel, longer ones to
# PyTorch's flash kernel (whose products also use the CPU's bfloat16 units), unless a measured
# choice says otherwise (`bench/prefill_attention.py`, one layer of the default model: on the tile
# unit of an Intel Sapphire Rapids native 0.56 ms at 478 tokens against flash's 1.48, 7.75 against
# 8.36 at 2,048, 31.7 against 29.2 at 4,096; on float32 vectors, before the batched rescaling, 1.28
# against 1.74 at 478 and 5.26 against 2.69 at 1,024; with the vector dot-product instruction on an
# AMD Zen 4 without AMX 1.42 against 6.35 at 478, 21.4 against 56.7 at 2,048, 72.6 against 157.7 at
# 4,096, the longest measured).
BF16_PREFILL_MAX_NEW_TOKENS = {"amx": 2048, "dot": 4096, "vectors": 640}


def _attention_code(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor) -> int | None:
    """The dtype code when q [T, Hq, D] and a layer's cache are what the attention kernels take
    (CPU, float32 or bfloat16 throughout, a head dim of HEAD_DIMS, at most MAX_GROUP query heads per
    KV head, the cache contiguous); else None."""
    if not _enabled or q.device.type != "cpu":
        return None
    code = DTYPE_CODES.get(q.dtype)
    Hq, D = q.shape[1], q.shape[2]
    Hkv = k_flat.shape[1]
    if (
        code is None
        or D not in HEAD_DIMS
        or k_flat.dtype != q.dtype
        or v_flat.dtype != q.dtype
        or Hq % Hkv
        or Hq // Hkv > MAX_GROUP
        or not (k_flat.is_contiguous() and v_flat.is_contiguous())
    ):
        return None
    return code


def decode_attention(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    lse: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Attention of one query token per sequence over its paged context, or None where the kernel
    does not apply (then the caller takes the PyTorch path).

    q [B, Hq, D]; k_flat, v_flat [num_slots, Hkv, D] (a layer's cache, contiguous); slots [B, L]
    int64, the context positions' slots (only the first lens[b] of row b are read); lens [B] int64.
    Returns [B, Hq, D] in q's dtype. `lse` [B, Hq] float32, if given, receives each row's log-sum-exp
    of scaled scores (for merging with attention over another part of the context)."""
    code = _attention_code(q, k_flat, v_flat)
    B, Hq, D = q.shape
    if (
        code is None
        or slots.dtype != torch.int64
        or lens.dtype != torch.int64
        or B == 0
        or (lse is not None and (lse.dtype != torch.float32 or lse.shape != (B, Hq) or not lse.is_contiguous()))
        or not _chosen("decode_attention", q.dtype)
    ):
        return None
    kernels = _kernels_or_none()
    if kernels is None:
        return None
    return calls.decode_attention_call(kernels.decode_attention, code, q, k_flat, v_flat, slots, lens, scale, lse)


def bf16_prefill_attention_unit() -> str:
    """What bfloat16 prefill attention multiplies on here: "amx" (the tile unit), "dot" (the vector
    bfloat16 dot-product instruction, AVX512-BF16), or "vectors" (float32 multiply-adds)."""
    kernels = _kernels_or_none() if _enabled else None
    return "vectors" if kernels is None else {1: "amx", 2: "dot"}.get(kernels.prefill_unit, "vectors")


def prefill_attention(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    seqs: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor | None = None,
) -> bool:
    """Causal attention of several sequences' new tokens over their paged context, written into
    `out`; False where the kernel does not apply (then nothing was written and the caller takes
    the PyTorch path).

    q [T, Hq, D] with its heads contiguous (rows may be further apart: a view into the fused q/k/v
    projection); out [T, Hq, D] contiguous; k_flat, v_flat [num_slots, Hkv, D] (a layer's cache, contiguous).
    seqs [S, 4] int64, per sequence: its first row in q, its new tokens n (>= 1), the keys it reads
    kv (>= n; the last n are the new tokens' own, already in the cache) and where its kv slots start
    in `slots` (int64). Query i of a sequence sees its keys 0 .. kv - n + i. `lse` [T, Hq] float32,
    if given, receives each written row's log-sum-exp of scaled scores."""
    code = _attention_code(q, k_flat, v_flat)
    T, Hq, D = q.shape
    if (
        code is None
        or out.dtype != q.dtype
        or out.shape != q.shape
        or q.stride(2) != 1
        or q.stride(1) != D
        or not out.is_contiguous()
        or seqs.dtype != torch.int64
        or seqs.dim() != 2
        or seqs.shape[1] != 4
        or not seqs.is_contiguous()
        or slots.dtype != torch.int64
        or not slots.is_contiguous()
        or (lse is not None and (lse.dtype != torch.float32 or lse.shape != (T, Hq) or not lse.is_contiguous()))
    ):
        return False
    kernels = _kernels_or_none()
    if kernels is None:
        return False
    run = calls.prefill_attention_call
    return run(kernels.prefill_attention, code, q, k_flat, v_flat, seqs, slots, scale, out, lse)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for the fused gate/up projection's output [..., 2 * I] (gate first), as
    `F.silu(g) * u` computes it; None where the kernel does not apply."""
    if not _enabled or gate_up.device.type != "cpu":
        return None
    code = DTYPE_CODES.get(gate_up.dtype)
    if code is None or not gate_up.is_contiguous() or gate_up.shape[-1] % 2 or gate_up.shape[-1] == 0:
        return None
    if not _chosen("silu_and_mul", gate_up.dtype):
        return None
    kernels = _kernels_or_none()
    if kernels is None:
        return None
    return calls.silu_and_mul_call(kernels.silu_and_mul, code, gate_up)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotates x [T, H, D] in place (heads contiguous, rows any distance apart) by the [T, D]
    (or [T, 1, D]) cos and signed-sine tables of layers.RotaryEmbedding, rounding as its PyTorch
    formulation; False where the kernel does not apply (then x is unchanged)."""
    if not _enabled or x.device.type != "cpu":
        return False
    code = DTYPE_CODES.get(x.dtype)
    if x.dim() != 3:
        return False
    T, H, D = x.shape
    if code is None or cos.numel() != T * D or sin.numel() != T * D:  # one table row per row of x
        return False
    if not _chosen("rotary", x.dtype):
        return False
    cos, sin = cos.reshape(T, D), sin.reshape(T, D)
    if (
        x.stride(2) != 1
        or x.stride(1) != D
        or cos.dtype != x.dtype
        or sin.dtype != x.dtype
        or not (cos.is_contiguous() and sin.is_contiguous())
    ):
        return False
    kernels = _kernels_or_none()
    if kernels is None:
        return False
    return calls.rotary_call(kernels.rotary, code, x, cos, sin)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, slot_mapping: torch.Tensor
) -> bool:
    """k_flat[slot_mapping] = k and v_flat[slot_mapping] = v (index_copy_ along dim 0), for k, v
    [T, Hkv, D] with each row's heads contiguous (rows any distance apart: views into the qkv
    output) and a layer's contiguous [num_slots, Hkv, D] cache of the same dtype; False where the
    kernel does not apply or a slot is out of range (then nothing was written)."""
    if not _enabled or k.device.type != "cpu" or k.dim() != 3 or v.shape != k.shape:
        return False
    T, H, D = k.shape
    if (
        k.dtype != k_flat.dtype
        or v.dtype != k_flat.dtype
        or v_flat.dtype != k_flat.dtype
        or k_flat.shape[1:] != k.shape[1:]
        or v_flat.shape != k_flat.shape
        or not (k_flat.is_contiguous() and v_flat.is_contiguous())
        or k.stride(2) != 1
        or k.stride(1) != D
        or v.stride(2) != 1
        or v.stride(1) != D
        or slot_mapping.dtype != torch.int64
        or slot_mapping.shape != (T,)
        or not slot_mapping.is_contiguous()
        or not _chosen("write_kv", k.dtype)
    ):
        return False
    kernels = _kernels_or_none()
    if kernels is None:
        return False
    rc = kernels.write_kv(
        k.element_size(),
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        slot_mapping.data_ptr(),
        T,
        H * D,
        k_flat.data_ptr(),
        v_flat.data_ptr(),
        k_flat.shape[0],
        torch.get_num_threads(),
    )
    return bool(rc == 0)


SMALL_LINEAR_MAX_ROWS = 16  # rows past which oneDNN's kernels are faster (bench/small_linear.py)


def small_linear_max_rows(dtype: torch.dtype) -> int:
    """The most rows `small_linear` takes for `dtype` here (0 where it does not run)."""
    if not small_linear_available(dtype):
        return 0
    made = _choices.get(dtype)
    if made is None or made.small_linear_max_rows is None:
        return SMALL_LINEAR_MAX_ROWS
    return min(made.small_linear_max_rows, SMALL_LINEAR_MAX_ROWS)


def small_linear_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether `small_linear` runs here for `dtype`: the kernels are on, the CPU has AVX-512 or
    AVX2 + FMA (float32) or AVX512-BF16 (bfloat16), and the timing chose it (kernel_choice)."""
    kernels = _kernels_or_none() if _enabled else None
    return kernels is not None and dtype in kernels.small_linear_dtypes and _chosen("small_linear", dtype)


def small_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [N, K] (float32 or bfloat16, CPU) laid out for `small_linear`: the output columns in
    blocks of 16, the blocks in pairs, and per pair the inputs in steps of 2 x 64 bytes ([ceil(N/32),
    K, 2, 16] float32, [ceil(N/32), K/2, 2, 16, 2] bfloat16), the last pair padded with zeros. None
    where the kernel does not take it (another dtype, bfloat16 with K odd, or no kernel for the dtype
    on this CPU)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not small_linear_available(weight.dtype):
        return None
    N, K = weight.shape
    if K == 0 or N == 0 or (weight.dtype == torch.bfloat16 and K % 2):
        return None
    return calls.small_linear_layout(weight.detach())


def small_linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """x [M, K] @ W.T (+ bias, float32 [N]) with W laid out by `small_linear_weight` (same dtype as
    x); [M, N] in x's dtype, or None where the kernel does not apply. Meant for the few rows of a
    decode step (weight-streaming bound); oneDNN is faster for many rows."""
    kernels = _kernels  # loaded by small_linear_available, which decides whether weights are laid out
    if not _enabled or kernels is None or kernels.small_linear is None or x.dtype not in kernels.small_linear_dtypes:
        return None
    if not _linear_args_fit(x, packed, out_features, bias):
        return None
    return calls.small_linear_call(kernels.small_linear, x, packed, out_features, bias)


def _linear_args_fit(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> bool:
    """Whether x, a weight laid out by `small_linear_weight` and bias fit the linear kernels."""
    if x.dim() != 2 or x.stride(1) != 1 or packed.dtype != x.dtype:
        return False
    K = x.shape[1]
    inputs = packed.shape[1] * (2 if x.dtype == torch.bfloat16 else 1)
    if inputs != K or packed.shape[0] != calls.small_linear_pairs(out_features) or not packed.is_contiguous():
        return False  # not the layout of an [out_features, K] weight
    return bias is None or (bias.dtype == torch.float32 and bias.shape == (out_features,) and bias.is_contiguous())


def blocked_linear_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether `blocked_linear` runs here for `dtype`: where `small_linear` does, the kernel passed its
    check, and the timing chose it over oneDNN's for a prefill's rows (kernel_choice)."""
    kernels = _kernels_or_none() if _enabled else None
    return (
        small_linear_available(dtype)
        and kernels is not None
        and dtype in kernels.blocked_linear_dtypes
        and _chosen("blocked_linear", dtype)
    )


def blocked_linear_faster(dtype: torch.dtype) -> bool:
    """Whether `blocked_linear` runs here for `dtype` and timed at least as fast as oneDNN (not only
    within the tolerance): then one copy of the weights is kept even where two would fit."""
    return blocked_linear_available(dtype) and _chosen("blocked_linear_faster", dtype)


def blocked_linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """`small_linear` for any number of rows (a prefill's): the same arguments, the same bits for every
    row; a blocked product within 3-11% of oneDNN's speed at a prefill's rows, where `small_linear` (which
    streams the weights once per 8 rows) falls far behind. None where the kernel does not apply."""
    kernels = _kernels
    if (
        not _enabled
        or kernels is None
        or kernels.blocked_linear is None
        or x.dtype not in kernels.blocked_linear_dtypes
    ):
        return None
    if not _linear_args_fit(x, packed, out_features, bias):
        return None
    return calls.small_linear_call(kernels.blocked_linear, x, packed, out_features, bias)


def decode_layers_available(dtype: torch.dtype) -> bool:
    """Whether `decode_layers` runs here for `dtype` (it is built of the small-batch linear, so it
    runs where that does)."""
    return small_linear_available(dtype) and _kernels is not None and _kernels.decode_layers is not None


def decode_layers(
    dims: torch.Tensor,
    weights: torch.Tensor,
    caches: torch.Tensor,
    h: torch.Tensor,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    eps: float,
    scale: float,
) -> bool:
    """Every decoder layer of a decode step in one native call (csrc/decode_layers.cpp: the
    arguments are described there); h is updated in place and x becomes the final norm's output.
    False where it does not run (then nothing was changed). The caller (LlamaModel) checks shapes,
    layouts and dtypes once per model and per step; this only guards the call."""
    kernels = _kernels
    fn = None if kernels is None else kernels.decode_layers
    code = DTYPE_CODES.get(h.dtype)
    if not _enabled or kernels is None or fn is None or code is None or h.dtype not in kernels.small_linear_dtypes:
        return False
    rc = fn(
        code,
        dims.data_ptr(),
        weights.data_ptr(),
        caches.data_ptr(),
        h.data_ptr(),
        x.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        slot_mapping.data_ptr(),
        slots.data_ptr(),
        lens.data_ptr(),
        float(eps),
        float(scale),
        torch.get_num_threads(),
    )
    return bool(rc == 0)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """h += delta (in place, in h's dtype) and returns rms_norm(h) * weight the way transformers'
    LlamaRMSNorm computes it; None where the kernel does not apply (then nothing was changed).
    h, delta [..., dim] contiguous, same dtype as weight [dim]."""
    if not _enabled or h.device.type != "cpu":
        return None
    code = DTYPE_CODES.get(h.dtype)
    if (
        code is None
        or weight.dtype != h.dtype
        or not h.is_contiguous()
        or (delta is not None and (delta.dtype != h.dtype or delta.shape != h.shape or not delta.is_contiguous()))
        or weight.numel() != h.shape[-1]
        or not weight.is_contiguous()
        or not _chosen("add_rms_norm", h.dtype)
    ):
        return None
    kernels = _kernels_or_none()
    if kernels is None:
        return None
    return calls.add_rms_norm_call(kernels.add_rms_norm, code, h, delta, weight, eps)
