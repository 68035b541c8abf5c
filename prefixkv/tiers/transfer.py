"""The worker-side half of the KV tiers: copies whole blocks between the KV caches and bytes.

A block's bytes are each layer's `[2, block_size, kv_heads, head_dim]` slice, layer after layer,
in the model dtype. One staging buffer (pinned when the caches are on CUDA) is reused for every
copy, so a transfer allocates only the value it produces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .manager import KVLoad, KVSave, TierManager


class BlockTransfer:
    def __init__(self, kv_caches: Sequence[torch.Tensor], block_dim: int, tiers: TierManager) -> None:
        self.kv_caches = list(kv_caches)
        self.block_dim = block_dim
        self.tiers = tiers
        first = self.kv_caches[0].select(block_dim, 0)
        self.dtype = first.dtype
        self.layer_shape = tuple(first.shape)
        self.layer_numel = first.numel()
        self.nbytes = self.layer_numel * len(self.kv_caches) * first.element_size()
        self._stage = bytearray(self.nbytes)
        stage = torch.frombuffer(self._stage, dtype=torch.uint8)
        if self.kv_caches[0].device.type == "cuda":
            pinned = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
            self._stage_t = pinned.view(self.dtype)
            self._pinned: torch.Tensor | None = pinned
        else:
            self._stage_t = stage.view(self.dtype)
            self._pinned = None
        self.stage_u8 = stage

    def _layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        n = self.layer_numel
        return [
            (cache, self._stage_t[i * n : (i + 1) * n].view(self.layer_shape)) for i, cache in enumerate(self.kv_caches)
        ]

    @torch.inference_mode()
    def load(self, loads: Sequence[KVLoad]) -> None:
        """Copy checked KV bytes into their blocks (before the forward that reads them)."""
        for load in loads:
            if self._pinned is not None:
                self._pinned.numpy()[:] = memoryview(load.kv).cast("B")
            else:
                self._stage[:] = load.kv
            for cache, src in self._layers():
                cache.select(self.block_dim, load.block_id).copy_(src, non_blocking=False)

    @torch.inference_mode()
    def save(self, saves: Sequence[KVSave]) -> None:
        """Copy completed blocks out (after the forward that wrote them) and store them."""
        for save in saves:
            for cache, dst in self._layers():
                dst.copy_(cache.select(self.block_dim, save.block_id))
            data = self._pinned.numpy().data if self._pinned is not None else memoryview(self._stage)
            self.tiers.store(save, data)
