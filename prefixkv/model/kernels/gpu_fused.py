"""Where the fused Triton steps (triton_fused.py) run: on CUDA tensors, unless
``PREFIXKV_CUDA_KERNELS=0`` (then PyTorch's formulation runs there, as with the CPU's
``PREFIXKV_CPU_KERNELS=0``; any value but 0 or 1 is refused by name). Each function returns None
(rotary_: False) where its kernel does not apply, and the caller runs the PyTorch formulation; the
conditions are the CPU kernels' (ops.py).

Triton is imported on the first CUDA tensor (it takes seconds); where it is missing, the PyTorch path
runs with one log line. The CPU tests set `run_on_cpu` with Triton's interpreter on
(tests/model/triton_interpreter.py) to run the kernels inside a model on CPU tensors.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from types import ModuleType

import torch

logger = logging.getLogger("prefixkv")

ENV_SWITCH = "PREFIXKV_CUDA_KERNELS"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
run_on_cpu = False  # tests only: CPU tensors through the kernels, under TRITON_INTERPRET=1
_module: ModuleType | None = None
_missing_logged = False


def switched_on() -> bool:
    """Whether PREFIXKV_CUDA_KERNELS leaves the fused kernels on (unset: on); a value it does not
    take is refused by name, not ignored."""
    switch = os.environ.get(ENV_SWITCH, "1").strip()
    if switch not in ("0", "1"):
        raise ValueError(f"{ENV_SWITCH}={switch!r}: expected 0 (PyTorch's operators) or 1 (the fused kernels)")
    return switch == "1"


def _kernels(t: torch.Tensor) -> ModuleType | None:
    global _module, _missing_logged
    kind = t.device.type
    if kind == "cuda":
        if not switched_on():
            return None
    elif not (kind == "cpu" and run_on_cpu):
        return None
    if _module is None:
        if importlib.util.find_spec("triton") is None:
            if not _missing_logged:
                _missing_logged = True
                logger.info("Triton is not installed: the GPU runs norms, rotary and SiLU as PyTorch operators")
            return None
        from . import triton_fused

        _module = triton_fused
        logger.info("the GPU runs norms, rotary and SiLU as fused Triton kernels (%s=0 turns them off)", ENV_SWITCH)
    return _module


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """h += delta (in place, in h's dtype) and returns weight * rms_norm(h), as ops.add_rms_norm."""
    kernels = _kernels(h)
    if (
        kernels is None
        or h.dtype not in DTYPES
        or weight.dtype != h.dtype
        or not h.is_contiguous()
        or (delta is not None and (delta.dtype != h.dtype or delta.shape != h.shape or not delta.is_contiguous()))
        or weight.numel() != h.shape[-1]
        or not weight.is_contiguous()
    ):
        return None
    out: torch.Tensor = kernels.add_rms_norm(h, delta, weight, eps)
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotates x [T, H, D] in place by layers.RotaryEmbedding's tables, as ops.rotary_."""
    kernels = _kernels(x)
    if kernels is None or x.dim() != 3 or x.dtype not in DTYPES:
        return False
    T, H, D = x.shape
    if cos.numel() != T * D or sin.numel() != T * D or cos.dtype != x.dtype or sin.dtype != x.dtype:
        return False
    cos, sin = cos.reshape(T, D), sin.reshape(T, D)
    if x.stride(2) != 1 or x.stride(1) != D or D % 2 or not (cos.is_contiguous() and sin.is_contiguous()):
        return False
    kernels.rotary_(x, cos, sin)
    return True


def runs_on(t: torch.Tensor) -> bool:
    """Whether the fused kernels take `t`'s device (a CUDA tensor with the switch on; a CPU one
    only in the tests' interpreter runs): callers check before preparing a kernel's arguments."""
    return _kernels(t) is not None


def _heads_rows(x: torch.Tensor, heads: int, D: int) -> bool:
    """[T, heads, D] with each row's heads contiguous (rows any distance apart)."""
    return x.dim() == 3 and x.shape[1:] == (heads, D) and x.stride(2) == 1 and x.stride(1) == D


def rotary_write_kv_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> bool:
    """q [T, Hq, D] and k [T, Hkv, D] rotated in place by layers.RotaryEmbedding's tables, and
    k_cache[slots] = k, v_cache[slots] = v, in one kernel: ops.rotary_ on both, then ops.write_kv.
    `norms` (q's weight, k's weight, eps): q's and k's heads RMS-normed first, as add_rms_norm
    norms (a q/k norm whose weights are in the model's dtype). False where the kernel does not
    apply (then nothing was done)."""
    kernels = _kernels(q)
    if kernels is None or q.dim() != 3 or k.dim() != 3 or q.dtype not in DTYPES:
        return False
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    tensors = (k, v, cos, sin, k_cache, v_cache, *(norms[:2] if norms is not None else ()))
    if norms is not None and not all(w.numel() == D and w.is_contiguous() for w in norms[:2]):
        return False
    if (
        D % 2
        or any(t.dtype != q.dtype or t.device != q.device for t in tensors)
        or not (_heads_rows(q, Hq, D) and _heads_rows(k, Hkv, D) and _heads_rows(v, Hkv, D))
        or k.shape[0] != T
        or v.shape[0] != T
        or cos.numel() != T * D
        or sin.numel() != T * D
        or k_cache.shape[1:] != (Hkv, D)
        or v_cache.shape != k_cache.shape
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or slots.dtype != torch.int64
        or slots.shape != (T,)
        or slots.device != q.device
        or not slots.is_contiguous()
    ):
        return False
    cos, sin = cos.reshape(T, D), sin.reshape(T, D)
    if not (cos.is_contiguous() and sin.is_contiguous()):
        return False
    kernels.rotary_write_kv_(q, k, v, cos, sin, k_cache, v_cache, slots, norms)
    return True


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of the fused gate/up projection's output, as ops.silu_and_mul."""
    kernels = _kernels(gate_up)
    width = gate_up.shape[-1]
    if kernels is None or gate_up.dtype not in DTYPES or not gate_up.is_contiguous() or width % 2 or width == 0:
        return None
    out: torch.Tensor = kernels.silu_and_mul(gate_up)
    return out


def _one_row(x: torch.Tensor, width: int) -> bool:
    return x.dim() == 2 and x.shape == (1, width) and x.is_contiguous() and x.dtype in DTYPES


def _product_weight(weight: torch.Tensor, x: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.dtype == x.dtype and weight.device == x.device and weight.is_contiguous()


def norm_linear(
    h: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(h + delta, RMSNorm(h + delta) @ weight.T) of one row h [1, K] in one kernel
    (triton_gemv.py; delta None: h itself), the new residual a tensor of its own: RMSNorm.add_and_norm
    then F.linear, to rounding."""
    kernels = _kernels(h)
    K = h.shape[-1]
    if (
        kernels is None
        or not _one_row(h, K)
        or (delta is not None and (not _one_row(delta, K) or delta.dtype != h.dtype))
        or norm_weight.shape != (K,)
        or norm_weight.dtype != h.dtype
        or not norm_weight.is_contiguous()
        or not _product_weight(weight, h)
        or weight.shape[1] != K
    ):
        return None
    from . import triton_gemv

    return triton_gemv.norm_linear(h, delta, norm_weight, eps, weight)


def silu_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """(silu(gate) * up) @ weight.T of one row gate_up [1, 2K] in one kernel (triton_gemv.py):
    silu_and_mul then F.linear, to rounding."""
    kernels = _kernels(gate_up)
    if kernels is None or not _product_weight(weight, gate_up) or not _one_row(gate_up, 2 * weight.shape[1]):
        return None
    from . import triton_gemv

    return triton_gemv.silu_linear(gate_up, weight)
