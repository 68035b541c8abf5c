"""The worker half of the KV tiers' connector: copies whole blocks between the per-block tensors
and bytes, and seals what it copies out into values (value.py) for the scheduler half to store.

A block's bytes are, in order, each KV layer's `[2, block_size, kv_heads, head_dim]` slice (model
dtype), then - with the stage-output cache on - the block's rows of every stage-output tensor
(`[block_size, D]`: hidden states, ...), so a block's stage outputs travel with its KV into the
tiers and back, under the same checks. One staging buffer (pinned when a tensor is on CUDA) is
reused for every copy, so a transfer allocates only the value it produces.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .plans import KVLoad, KVSave, SavedBlock
from .value import seal


def block_nbytes(parts: Sequence[tuple[torch.Tensor, int]]) -> int:
    """Bytes of one block across `parts` ((tensor, block axis) pairs)."""
    return sum(t.select(dim, 0).numel() * t.element_size() for t, dim in parts)


class BlockTransfer:
    def __init__(self, parts: Sequence[tuple[torch.Tensor, int]], secret: bytes | None = None) -> None:
        """`parts`: (tensor, its block axis) of everything a block carries, in value order.
        `secret`: the tier secret, whose MAC seals every value (never logged)."""
        self.parts = list(parts)
        self._secret = secret
        self.nbytes = block_nbytes(self.parts)
        self._stage = bytearray(self.nbytes)
        if any(t.device.type == "cuda" for t, _ in self.parts):
            self._pinned: torch.Tensor | None = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
            stage = self._pinned
        else:
            self._pinned = None
            stage = torch.frombuffer(self._stage, dtype=torch.uint8)
        # (tensor, block axis, this part's typed view of the staging buffer)
        self._views: list[tuple[torch.Tensor, int, torch.Tensor]] = []
        offset = 0
        for t, dim in self.parts:
            one = t.select(dim, 0)
            n = one.numel() * t.element_size()
            self._views.append((t, dim, stage[offset : offset + n].view(t.dtype).view(one.shape)))
            offset += n

    @torch.inference_mode()
    def load(self, loads: Sequence[KVLoad]) -> None:
        """Copy checked bytes into their blocks (before the forward that reads them)."""
        for load in loads:
            if self._pinned is not None:
                self._pinned.numpy()[:] = memoryview(load.kv).cast("B")
            else:
                self._stage[:] = load.kv
            for tensor, dim, src in self._views:
                tensor.select(dim, load.block_id).copy_(src, non_blocking=False)

    @torch.inference_mode()
    def save(self, saves: Sequence[KVSave]) -> list[SavedBlock]:
        """Copy completed blocks out (after the forward that wrote them) and seal them."""
        saved = []
        for save in saves:
            for tensor, dim, dst in self._views:
                dst.copy_(tensor.select(dim, save.block_id))
            data = self._pinned.numpy().data if self._pinned is not None else memoryview(self._stage)
            if save.owner is not None:  # keyed and sealed when its last token is known (KVSave.owner)
                saved.append(SavedBlock(save, bytes(data)))
            else:
                saved.append(SavedBlock(save, seal(save.head, data, save.key, self._secret)))
        return saved
