"""Host tensors on their way to a device without making the host wait for it.

A plain `torch.tensor(values, device="cuda")` (or `.to("cuda")`) copies from pageable memory and
then synchronizes the stream: the host stops until the device has finished everything queued
before. Copied from page-locked memory with `non_blocking=True`, the copy takes its place in the
stream and the host goes on - what lets the engine launch a step while the previous one still
runs (async scheduling, engine/llm_engine.py). Page-locked blocks come from PyTorch's caching host
allocator, which keeps each one until the copies reading it are done. On a CPU nothing is copied.
"""

from __future__ import annotations

from typing import Any

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor `t` on `device`, copied in stream order (itself on a CPU)."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def tensor_on(values: Any, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host list as a tensor on `device`, copied in stream order."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def pinned_for(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor `t` ready for `buffer.copy_(..., non_blocking=True)` into a buffer on `device`:
    page-locked where that is a GPU."""
    return t if device.type == "cpu" else t.pin_memory()
