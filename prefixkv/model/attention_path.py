"""Which path reads a step's cached context on a device: Triton's paged kernels
(`kernels/triton_attention.py`, the K/V blocks read in place) or the gather path (the context
copied through the block tables, then PyTorch's attention).

``PREFIXKV_CUDA_ATTENTION=triton|gather`` picks on CUDA; ``triton`` is the default there: on an
H100 (2026-11-27, bench/paged_attention.py, docs/benchmarks.md) it took 1.4-1.6x less time than the
gather for prefill after 1k-8k tokens of context and 1.7-3.3x less for decode after 8k, and 5-26%
more only at a few small shapes. A CPU keeps its native kernels, which read in place already, and
takes ``triton`` only when asked for under Triton's interpreter (``TRITON_INTERPRET=1``): how the
CPU tests run the CUDA path's wiring end to end.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from types import ModuleType

import torch

logger = logging.getLogger("prefixkv")

ENV = "PREFIXKV_CUDA_ATTENTION"
CHOICES = ("gather", "triton")
_logged: set[tuple[str, str]] = set()


def uses_triton(device: torch.device) -> bool:
    """Whether attention on `device` reads the context with the Triton kernels (logged once per
    device type and choice). A request for Triton where it cannot be imported is an error."""
    asked = os.environ.get(ENV, "").strip().lower()
    if asked and asked not in CHOICES:
        raise ValueError(f"{ENV}={asked!r}: expected one of {', '.join(CHOICES)}")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    if device.type not in ("cuda", "cpu"):
        return False
    choice = asked or ("triton" if device.type == "cuda" else "gather")
    if choice == "triton" and importlib.util.find_spec("triton") is None:
        if asked:
            raise RuntimeError(f"{ENV}=triton, but Triton is not installed")
        choice = "gather"  # the default without Triton (its log line below says which)
    if (device.type, choice) not in _logged:
        _logged.add((device.type, choice))
        logger.info("attention on %s reads the cached context with the %s path", device.type, choice)
    return choice == "triton"


def triton_kernels() -> ModuleType:
    """The Triton kernels' module, imported on first use (Triton takes seconds to import)."""
    from .kernels import triton_attention

    return triton_attention
