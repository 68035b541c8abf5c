"""Large CPU tensors on transparent huge pages (2 MiB) where Linux offers them.

A decode step reads every running sequence's K and V from the cache, block by block, scattered
over the whole allocation. On 4 KiB pages each block of a layer costs TLB misses and the hardware
prefetcher stops at every page boundary; on 2 MiB pages neither. Paged decode attention of one
layer, 24 sequences x 500 bfloat16 keys from memory (bench/decode_attention.py, Zen 4): about 20%
less time on huge pages, 40% at 64 sequences.

Linux hands out huge pages to regions that ask (madvise MADV_HUGEPAGE) when its THP mode is
"madvise" (the common default; "always" needs no asking, "never" refuses), and only to pages not
yet touched - so the advice comes between allocation and the first write. Elsewhere (other
systems, THP off, a region too small to hold one aligned huge page) the tensor is an ordinary one:
the advice changes speed, never contents.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys

import torch

HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = 14  # <sys/mman.h>, Linux

_madvise = None
if sys.platform.startswith("linux"):
    try:
        _madvise = ctypes.CDLL(None, use_errno=True).madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        _madvise = None


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back the 2 MiB-aligned interior of a CPU tensor's memory with huge pages
    (pages touched before keep their size). Returns whether the advice was taken."""
    if _madvise is None or tensor.device.type != "cpu" or tensor.is_pinned():
        return False
    start = tensor.data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    last = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if last <= first:
        return False
    return bool(_madvise(first, last - first, MADV_HUGEPAGE) == 0)


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose pages are huge where the system allows (see the module doc).

    A tensor of a huge page or more gets a mapping of its own, starting on a huge page boundary,
    instead of malloc's memory: after an engine is freed, malloc serves even a 64 MiB request
    from the heap memory it left behind, whose pages were touched before and keep 4 KiB (measured:
    no huge page at all for the second engine of a process). The mapping is unmapped when the
    last tensor viewing it is freed (the tensor holds the mmap object)."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if _madvise is None or nbytes < HUGE_PAGE_BYTES:
        return torch.zeros(shape, dtype=dtype)
    # private: a shared anonymous mapping is shmem, whose huge pages follow another setting
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE)  # anonymous, zero-filled
    probe = ctypes.c_char.from_buffer(region)
    base = ctypes.addressof(probe)
    del probe  # a live export would keep the region from ever being unmapped
    offset = -base % HUGE_PAGE_BYTES
    tensor = torch.frombuffer(region, dtype=dtype, count=numel, offset=offset).view(shape)
    advise_huge_pages(tensor)
    return tensor.zero_()  # the first touch: the advised region faults in as huge pages now, not mid-step
