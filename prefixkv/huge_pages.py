"""Large CPU tensors on transparent huge pages (2 MiB) where Linux offers them.

A decode step reads every running sequence's K and V from the cache, block by block, scattered
over the whole allocation. On 4 KiB pages each block of a layer costs TLB misses and the hardware
prefetcher stops at every page boundary; on 2 MiB pages neither. Paged decode attention of one
layer, 24 sequences x 500 bfloat16 keys from memory (bench/decode_attention.py, Zen 4): about 20%
less time on huge pages, 40% at 64 sequences.

A decode step also streams every weight it multiplies, laid out once for the native kernels
(model/kernels/calls.small_linear_layout, `empty` here): on 2 MiB pages gpt-oss-20b's expert
product (5,760 x 2,880 float32, 2 threads, AMD EPYC Zen 2) read 2-11% faster at 1-8 rows.

Linux hands out huge pages to regions that ask (madvise MADV_HUGEPAGE) when its THP mode is
"madvise" (the common default; "always" needs no asking, "never" refuses), and only to pages not
yet touched - so the advice comes between allocation and the first write. Elsewhere (other
systems, THP off, a region too small to hold one aligned huge page) the tensor is an ordinary one:
the advice changes speed, never contents.

Faulting the pages in is what costs: a 1 GiB cache took 1.5-3 s on the 2-vCPU Zen 4 VM (the
hypervisor backs each new page), 10-20x the time of writing it once faulted. An engine's cache is
made with `populate="background"`: where Linux has MADV_POPULATE_WRITE (5.14+) one worker thread
asks the kernel to fault the pages in, a few MiB at a time, while the engine lays its weights out -
the request writes nothing, so a step that writes the cache meanwhile loses nothing (a page it
reaches first it faults itself). On the VM the engine's KV-cache stage went from 1.0-2.6 s to
0.0-0.3 s. Elsewhere the pages are faulted in at once, as before.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import queue
import sys
import threading

import torch

HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = 14  # <sys/mman.h>, Linux
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in, writable, without writing them

# Background faulting: one worker thread takes the regions in order (an engine's 30 layer caches
# would otherwise be 30 threads competing with the start they are meant to stay out of the way
# of); whether the kernel takes MADV_POPULATE_WRITE is learnt from the first region.
_queue: queue.Queue[tuple[int, int, object]] = queue.Queue()
_worker: threading.Thread | None = None
_worker_lock = threading.Lock()
_populate_works: bool | None = None
POPULATE_PIECE = 2 * HUGE_PAGE_BYTES

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


def zeros(shape: tuple[int, ...], dtype: torch.dtype, populate: str = "now") -> torch.Tensor:
    """A zeroed CPU tensor whose pages are huge where the system allows (see the module doc).

    A tensor of a huge page or more gets a mapping of its own, starting on a huge page boundary,
    instead of malloc's memory: after an engine is freed, malloc serves even a 64 MiB request
    from the heap memory it left behind, whose pages were touched before and keep 4 KiB (measured:
    no huge page at all for the second engine of a process). The mapping is unmapped when the
    last tensor viewing it is freed (the tensor holds the mmap object).

    `populate`: "now" faults every page in before returning (no fault mid-step); "background"
    leaves that to a thread where the kernel can do it without writes (MADV_POPULATE_WRITE), else
    does it now (see the module doc)."""
    tensor = _advised_mapping(shape, dtype)
    if tensor is None:
        return torch.zeros(shape, dtype=dtype)
    if populate == "background" and _populate_in_background(tensor.data_ptr(), tensor.numel() * dtype.itemsize, tensor):
        return tensor
    return tensor.zero_()  # the first touch: the advised region faults in as huge pages now, not mid-step


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor for the caller to write in full (a weight's layout), on huge pages where the
    system allows: a mapping of its own as in `zeros`, its pages faulted in by that first write.
    Below a huge page, or where Linux offers none, torch.empty's."""
    tensor = _advised_mapping(shape, dtype)
    return torch.empty(shape, dtype=dtype) if tensor is None else tensor


def _advised_mapping(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """A tensor on an anonymous mapping of its own, starting on a huge page boundary, advised and
    untouched (zero when read); None below a huge page, where there is no madvise, or where the
    mapping is refused."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if _madvise is None or nbytes < HUGE_PAGE_BYTES:
        return None
    try:  # private: a shared anonymous mapping is shmem, whose huge pages follow another setting
        region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE)  # anonymous, zero-filled
    except OSError:  # out of mappings (vm.max_map_count) or of address space: malloc's memory then
        return None
    probe = ctypes.c_char.from_buffer(region)
    base = ctypes.addressof(probe)
    del probe  # a live export would keep the region from ever being unmapped
    offset = -base % HUGE_PAGE_BYTES
    tensor = torch.frombuffer(region, dtype=dtype, count=numel, offset=offset).view(shape)
    advise_huge_pages(tensor)
    return tensor


def _populate_write(address: int, nbytes: int) -> bool:
    """Fault [address, address + nbytes) in, writable, without writing (ctypes releases the GIL
    meanwhile). False where the kernel does not take MADV_POPULATE_WRITE."""
    if _madvise is None:
        return False
    start = address // mmap.PAGESIZE * mmap.PAGESIZE
    return bool(_madvise(start, address + nbytes - start, MADV_POPULATE_WRITE) == 0)


def _populate_in_background(address: int, nbytes: int, keep: object) -> bool:
    """Queue [address, address + nbytes) for the worker (which holds `keep`, so the mapping outlives
    the request). False where the kernel does not take MADV_POPULATE_WRITE (asked once, on the
    first huge page of the first region, here)."""
    global _populate_works, _worker
    if _populate_works is None:
        _populate_works = _populate_write(address, min(nbytes, HUGE_PAGE_BYTES))
    if not _populate_works:
        return False
    with _worker_lock:
        if _worker is None:
            _worker = threading.Thread(target=_populate_worker, name="prefixkv-populate", daemon=True)
            _worker.start()
    _queue.put((address, nbytes, keep))
    return True


def _populate_worker() -> None:
    while True:
        address, nbytes, keep = _queue.get()
        try:
            # in pieces: the kernel holds the address space's lock while it faults a piece in, and
            # the engine's own mmap/munmap calls (the next cache, large tensors) wait for it - whole
            # regions made 30 caches' allocation take 1.7 s instead of 0.04
            for offset in range(0, nbytes, POPULATE_PIECE):
                _populate_write(address + offset, min(POPULATE_PIECE, nbytes - offset))
        finally:
            del keep
            _queue.task_done()


def _after_fork_in_child() -> None:
    """A forked child has no worker (threads do not fork): its own queue and worker when it asks."""
    global _queue, _worker
    _queue, _worker = queue.Queue(), None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def wait_populated() -> None:
    """Wait until the background faulting of every tensor made so far is done (tests, benches)."""
    _queue.join()
