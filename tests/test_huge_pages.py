"""The K/V caches on 2 MiB pages where Linux offers them (prefixkv/huge_pages.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from prefixkv import huge_pages
from prefixkv.memory.block_tensors import BlockTensors, BlockTensorSpec
from prefixkv.model.kernels import ops

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """'always', 'madvise' or 'never' (the bracketed word), None where the system has no THP."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


def huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address`, in bytes."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0


def test_zeros_is_zeros_of_the_shape_and_dtype():
    t = huge_pages.zeros((3, 5, 7), torch.bfloat16)
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert torch.count_nonzero(t) == 0


def test_a_tensor_too_small_for_one_huge_page_is_left_alone():
    assert not huge_pages.advise_huge_pages(torch.empty(1000))


@pytest.mark.skipif(not sys.platform.startswith("linux") or thp_mode() not in ("madvise", "always"), reason="no THP")
def test_a_large_cache_lies_on_huge_pages():
    t = huge_pages.zeros((16, 1 << 20), torch.float32)  # 64 MiB: at least 31 aligned huge pages inside
    assert huge_bytes_at(t.data_ptr() + t.numel() * 2) >= 16 * huge_pages.HUGE_PAGE_BYTES


@pytest.mark.skipif(not sys.platform.startswith("linux") or thp_mode() not in ("madvise", "always"), reason="no THP")
def test_the_engines_kv_caches_take_the_advice():
    tensors = BlockTensors([BlockTensorSpec("kv.0", (2, 16, 3, 64), torch.bfloat16, 1)])
    tensors.allocate(4096, "cpu")  # 48 MiB
    kv = tensors.kv_caches[0]
    huge_pages.wait_populated()  # faulted in by a thread, where the kernel has MADV_POPULATE_WRITE
    assert torch.count_nonzero(kv) == 0
    assert huge_bytes_at(kv.data_ptr() + kv.numel()) >= 8 * huge_pages.HUGE_PAGE_BYTES


@pytest.mark.skipif(not sys.platform.startswith("linux") or thp_mode() not in ("madvise", "always"), reason="no THP")
def test_huge_pages_after_the_heap_has_room():
    """What a freed engine leaves behind: malloc raises its mmap threshold when a large block is
    freed, later large blocks come from the heap, and once freed they make a free heap region that
    serves even a 64 MiB request - on pages touched before. The cache must not land there."""
    first = torch.ones(6 << 20)  # 24 MiB, mmapped; freeing it raises the threshold
    del first
    junk = [torch.ones(5 << 20) for _ in range(24)]  # 20 MiB each, now from the heap
    del junk
    t = huge_pages.zeros((16, 1 << 20), torch.float32)
    assert torch.count_nonzero(t) == 0
    assert huge_bytes_at(t.data_ptr() + t.numel() * 2) >= 16 * huge_pages.HUGE_PAGE_BYTES


@pytest.mark.skipif(not sys.platform.startswith("linux") or thp_mode() not in ("madvise", "always"), reason="no THP")
def test_background_faulting_never_changes_what_is_written():
    """The thread asks for pages without writing: values written meanwhile stay, the rest is zero."""
    t = huge_pages.zeros((64, 1 << 20), torch.float32, populate="background")  # 256 MiB
    t[::7].fill_(3.0)  # while (probably) still being faulted in
    huge_pages.wait_populated()
    assert torch.equal(t[::7], torch.full_like(t[::7], 3.0))
    rest = torch.ones(64, dtype=torch.bool)
    rest[::7] = False
    assert torch.count_nonzero(t[rest]) == 0
    assert huge_bytes_at(t.data_ptr() + t.numel() * 2) >= 64 * huge_pages.HUGE_PAGE_BYTES


def test_empty_below_a_huge_page_is_torch_empty():
    t = huge_pages.empty((3, 5), torch.float32)
    assert t.shape == (3, 5) and t.dtype == torch.float32 and t.is_contiguous()


@pytest.mark.skipif(not sys.platform.startswith("linux") or thp_mode() not in ("madvise", "always"), reason="no THP")
def test_a_large_weights_layout_lies_on_huge_pages_and_multiplies_the_same():
    """The native kernels' layout of a weight (what a decode step streams) is written into memory
    advised before its first touch: huge pages, and the product of a copy on ordinary pages."""
    if not ops.small_linear_available(torch.float32):
        pytest.skip("no native float32 linear on this CPU")
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(2080, 2048, generator=g)  # 17 MiB: 8 aligned huge pages inside, 65 pairs
    packed = ops.small_linear_weight(weight)
    assert packed is not None
    assert huge_bytes_at(packed.data_ptr() + packed.numel() * 2) >= 4 * huge_pages.HUGE_PAGE_BYTES
    plain = packed.clone()  # torch's own memory
    x = torch.randn(3, 2048, generator=g)
    assert torch.equal(ops.small_linear(x, packed, 2080), ops.small_linear(x, plain, 2080))
    want = torch.nn.functional.linear(x, weight)  # the same products, summed in another order
    torch.testing.assert_close(ops.small_linear(x, packed, 2080), want, rtol=1e-5, atol=1e-3)


def test_without_a_mapping_the_tensors_are_ordinary_ones(monkeypatch):
    """Where the process may not map more (vm.max_map_count, address space), large tensors come
    from malloc as before: the advice is speed, never a failure."""

    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(huge_pages.mmap, "mmap", refuse)
    t = huge_pages.zeros((4, 1 << 20), torch.float32)
    assert t.shape == (4, 1 << 20) and torch.count_nonzero(t) == 0
    e = huge_pages.empty((4, 1 << 20), torch.float32)
    assert e.shape == (4, 1 << 20) and e.is_contiguous()
