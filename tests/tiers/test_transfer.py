"""The worker half's copies (tiers/transfer.py): a value holds its block's bytes in value order,
whether the blocks go straight to the host (a CPU) or through a device buffer and host memory (a
GPU's path, forced here), in one copy or several; what a save copied is what the block held when
it was saved, however late the value is read; loads put back exactly those bytes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prefixkv.tiers.plans import KVLoad, KVSave
from prefixkv.tiers.transfer import BlockTransfer
from prefixkv.tiers.value import seal

NUM_BLOCKS = 12


DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def _parts(odd: bool = False, device: str = "cpu") -> list[tuple[torch.Tensor, int]]:
    """Two KV layers (bfloat16, block axis 1, as the engine's caches) and a stage-output tensor
    (float32, block axis 0). `odd`: a tensor of 6 bytes a block before the last, so that the
    float32 bytes after it start misaligned (the host rows cannot be viewed in its dtype, and
    the staging buffer must align each tensor's region)."""
    g = torch.Generator().manual_seed(0)
    kv = [(torch.randn(2, NUM_BLOCKS, 4, 2, 8, generator=g).to(torch.bfloat16), 1) for _ in range(2)]
    if odd:
        kv.append((torch.randn(NUM_BLOCKS, 3, generator=g).to(torch.bfloat16), 0))
    parts = [*kv, (torch.randn(NUM_BLOCKS, 4, 6, generator=g), 0)]
    return [(t.to(device), dim) for t, dim in parts]


def _block_bytes(parts: list[tuple[torch.Tensor, int]], block: int) -> bytes:
    return b"".join(t.select(dim, block).contiguous().view(torch.uint8).cpu().numpy().tobytes() for t, dim in parts)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("odd", [False, True])
@pytest.mark.parametrize("through_host", [False, True])
@pytest.mark.parametrize("per_copy", [1, 2, NUM_BLOCKS])
def test_values_hold_each_block_in_value_order_and_load_back(through_host, per_copy, odd, device):
    """On a GPU the copies always go through the host, in stream order."""
    parts = _parts(odd, device)
    secret = b"s" * 32
    nbytes = len(_block_bytes(parts, 0))
    xfer = BlockTransfer(parts, secret, through_host=through_host, stage_bytes=per_copy * nbytes)
    assert xfer.nbytes == nbytes
    assert xfer._through_host == (through_host or odd or device != "cpu")
    blocks = [7, 2, 9, 4, 0]
    saves = [KVSave(b, b"key%d" % b, b"head%d" % b) for b in blocks]
    saves[3].owner = ("req", 1)  # completed ahead: its bytes alone, sealed at booking
    want = [_block_bytes(parts, b) for b in blocks]
    pending = xfer.save(saves)
    for t, _ in parts:  # written after the copy was made: not in the values
        t.fill_(3)
    values = pending.result()
    assert pending.result() is values
    assert [v.save for v in values] == saves
    for v, kv, save in zip(values, want, saves):
        assert v.value == (kv if save.owner else seal(save.head, kv, save.key, secret))

    # back into other blocks
    targets = [1, 3, 5, 6, 11]
    xfer.load([KVLoad(b, memoryview(kv)) for b, kv in zip(targets, want)])
    for b, kv in zip(targets, want):
        assert _block_bytes(parts, b) == kv
    threes = [(torch.full_like(t, 3), dim) for t, dim in parts]
    assert all(_block_bytes(parts, b) == _block_bytes(threes, b) for b in (0, 2, 4, 7, 8, 9, 10))  # not loaded


@pytest.mark.parametrize("device", DEVICES)
def test_a_copy_through_the_host_is_sealed_when_read(device):
    """Through the host the values are made when first read (on a GPU, when the step is booked),
    from what was copied when the step saved."""
    parts = _parts(device=device)
    xfer = BlockTransfer(parts, through_host=True)
    direct = BlockTransfer([(t.cpu(), dim) for t, dim in parts])
    saves = [KVSave(5, b"k", b"h")]
    pending = xfer.save(saves)
    assert pending._values is None  # nothing sealed yet
    want = direct.save(saves).result()
    parts[0][0].zero_()
    assert pending.result() == want


@pytest.mark.parametrize("device", DEVICES)
def test_rows_kept_in_host_memory_travel_with_the_device_s_blocks(device):
    """An engine on a GPU keeps the stage-output cache's rows in host memory: its values carry
    them beside the device's K/V, in value order, and loads put both back. (On a CPU the last
    tensor is taken for one in host memory: the same path, every tensor on the CPU.)"""
    parts = _parts(device=device)
    if device == "cuda":
        parts[-1] = (parts[-1][0].cpu().pin_memory(), parts[-1][1])
        xfer = BlockTransfer(parts)
    else:
        xfer = BlockTransfer(parts, through_host=True)
        xfer._layout[-1] = dataclasses.replace(xfer._layout[-1], on_host=True)
    assert [p.on_host for p in xfer._layout] == [False, False, True]
    blocks = [3, 8, 1]
    saves = [KVSave(b, b"key%d" % b, b"head") for b in blocks]
    want = [_block_bytes(parts, b) for b in blocks]
    pending = xfer.save(saves)
    for t, _ in parts:
        t.fill_(5)
    assert [v.value for v in pending.result()] == [seal(s.head, kv, s.key, None) for s, kv in zip(saves, want)]
    xfer.load([KVLoad(b, memoryview(kv)) for b, kv in zip([0, 4, 11], want)])
    assert [_block_bytes(parts, b) for b in (0, 4, 11)] == want
