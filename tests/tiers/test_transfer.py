"""The worker half's copies (tiers/transfer.py): a value holds its block's bytes in value order,
whether the blocks go straight to the host (a CPU) or through a device buffer and host memory (a
GPU's path, forced here), in one copy or several; what a save copied is what the block held when
it was saved, however late the value is read; loads put back exactly those bytes."""

from __future__ import annotations

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
@pytest.mark.parametrize("per_copy", [1, NUM_BLOCKS])
def test_booked_rows_move_when_the_step_is_booked(device, per_copy):
    """The stage-output cache's rows (host memory, written when a step is booked) travel beside
    the device's K/V, in value order. A save copies the K/V at once but gathers the rows when it
    is sealed (the step's own rows are written at its booking, before); a load puts the K/V back
    at once and the rows when `finish` is called (the steps before it booked)."""
    parts = _parts(device=device)
    rows, dim = parts[-1]
    parts[-1] = (rows.cpu().pin_memory() if device == "cuda" else rows, dim)
    nbytes = len(_block_bytes(parts, 0))
    xfer = BlockTransfer(parts, booked=1, stage_bytes=per_copy * nbytes)
    assert [p.booked for p in xfer._layout] == [False, False, True] and xfer._through_host
    blocks = [3, 8, 1]
    saves = [KVSave(b, b"key%d" % b, b"head") for b in blocks]
    pending = xfer.save(saves)
    for t, _ in parts[:-1]:  # a later step's K/V: not in the values
        t.fill_(5)
    kv_then = [_block_bytes(parts[:-1], b) for b in blocks]
    parts[-1][0].fill_(7)  # the saving step's rows, written when it is booked: in them
    want = [_block_bytes(_parts(device=device)[:-1], b) + _block_bytes(parts[-1:], b) for b in blocks]
    assert all(w[: len(k)] != k for w, k in zip(want, kv_then))
    assert [v.value for v in pending.result()] == [seal(s.head, kv, s.key, None) for s, kv in zip(saves, want)]

    targets = [0, 4, 11]
    loads = xfer.load([KVLoad(b, memoryview(kv)) for b, kv in zip(targets, want)])
    assert [_block_bytes(parts[:-1], b) for b in targets] == [kv[: len(kv_then[0])] for kv in want]
    assert all(_block_bytes(parts[-1:], b) == _block_bytes(parts[-1:], 5) for b in targets)  # the rows: not yet
    loads.finish()
    assert [_block_bytes(parts, b) for b in targets] == want
    loads.finish()  # once
    assert [_block_bytes(parts, b) for b in targets] == want


def test_booked_rows_are_in_host_memory():
    parts = _parts()
    with pytest.raises(ValueError, match="host memory"):
        BlockTransfer([(t.to("meta"), d) if i == 2 else (t, d) for i, (t, d) in enumerate(parts)], booked=1)
