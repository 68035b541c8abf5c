"""Which path reads a step's cached context on a device: Triton's paged kernels
(`kernels/triton_attention.py`, the K/V blocks read in place) or the gather path (the context
copied through the block tables, then PyTorch's attention).

``PREFIXKV_CUDA_ATTENTION=triton|gather`` picks on CUDA; ``gather`` is the default until the
Triton kernels' speed is measured on a GPU (docs/benchmarks.md). A CPU keeps its native kernels,
which read in place already, and takes ``triton`` only under Triton's interpreter
(``TRITON_INTERPRET=1``): how the CPU tests run the CUDA path's wiring end to end.
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
    choice = os.environ.get(ENV, "").strip().lower() or "gather"
    if choice not in CHOICES:
        raise ValueError(f"{ENV}={choice!r}: expected one of {', '.join(CHOICES)}")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    if device.type not in ("cuda", "cpu"):
        return False
    if choice == "triton" and importlib.util.find_spec("triton") is None:
        raise RuntimeError(f"{ENV}=triton, but Triton is not installed")
    if (device.type, choice) not in _logged:
        _logged.add((device.type, choice))
        logger.info("attention on %s reads the cached context with the %s path", device.type, choice)
    return choice == "triton"


def triton_kernels() -> ModuleType:
    """The Triton kernels' module, imported on first use (Triton takes seconds to import)."""
    from .kernels import triton_attention

    return triton_attention
