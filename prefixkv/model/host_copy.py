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

import numpy as np
import torch

# integer dtypes whose host tensors are built through NumPy (host_ints)
_NUMPY_INTS = {torch.long: np.int64, torch.int32: np.int32}


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor `t` on `device`, copied in stream order (itself on a CPU)."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def host_ints(values: Any, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype) for a (rectangular, nested) list of ints and an integer
    `dtype` (int64, int32), built by NumPy: a step's ids, positions and slots at batch 256 took 40
    us where torch.tensor took 230 (a 2-vCPU AMD EPYC Zen 3); host time in every step."""
    return torch.from_numpy(np.array(values, dtype=_NUMPY_INTS[dtype]))


def tensor_on(values: Any, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host list as a tensor on `device`, copied in stream order (integer lists given an int64
    or int32 `dtype` built by NumPy: host_ints)."""
    t = host_ints(values, dtype) if dtype in _NUMPY_INTS else torch.tensor(values, dtype=dtype)
    return to_device(t, device)


def pinned_for(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor `t` ready for `buffer.copy_(..., non_blocking=True)` into a buffer on `device`:
    page-locked where that is a GPU."""
    return t if device.type == "cpu" else t.pin_memory()


class HostCopies:
    """Device tensors copied to page-locked host memory in stream order, read once those copies are
    done (`wait`). Started right after the operations that make the tensors, the copies sit in the
    stream before anything launched later, so reading them waits for those operations alone - not,
    as `.tolist()` on the device tensor would, for a step launched after them (async scheduling).
    On a CPU: the tensors themselves."""

    __slots__ = ("tensors", "_done")

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._done: torch.cuda.Event | None = None
        if not tensors or tensors[0].device.type != "cuda":
            self.tensors = tensors
            return
        pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        self.tensors = [host.copy_(t, non_blocking=True) for host, t in zip(pinned, tensors)]
        self._done = torch.cuda.Event()
        self._done.record()

    def wait(self) -> list[torch.Tensor]:
        if self._done is not None:
            self._done.synchronize()
            self._done = None
        return self.tensors
