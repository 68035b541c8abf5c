"""StageOutputCache: per-token outputs kept per KV block id, valid only while the block still
holds the identity it held when its rows were written.

Rows are written through the step's slot mapping (the KV cache's own addressing: slot
`block_id * block_size + offset`), into CPU tensors `(num_blocks, block_size, D)` that the
engine's `BlockTensors` owns and counts in its one budget. A block's rows become readable when the
block is full and cached, and stay readable only while the block keeps that identity: the cache
records the block's identity number (`uid`) at write time and compares it with the block's
current one on every check. Eviction zeroes a block's uid and reuse gives it a new number (never
handed out twice), so an evicted or reused block can never be read - no hook in the cache layer
is needed, and `prefixkv/cache/` knows nothing of this cache.

A step's rows are written when the step is booked (`stage` at launch, `StagedRows.write` at
booking), not when it is launched: on a GPU they reach host memory in stream order, so the host
never waits for the forward that computes them, and a step launched before the one before it is
booked (async scheduling) does not hold the host. Steps are booked in the order they were
launched, and the tiers move a block's rows at booking too (tiers/transfer.py), so the rows change
in the order an engine that waits for every step would change them. Reads happen at launch, of
blocks made readable at an earlier booking (`commit`; engine/scheduler.py says when).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch

from ..memory.block_tensors import BlockTensors
from ..model.host_copy import HostCopies, to_device
from .specs import HIDDEN_STATES, spec_name


class _Block(Protocol):
    """What the cache reads of a KV block (prefixkv.cache.KVCacheBlock satisfies it)."""

    @property
    def uid(self) -> int: ...


class StageOutputCache:
    def __init__(self, block_tensors: BlockTensors, blocks: Sequence[_Block], block_size: int) -> None:
        if not block_tensors.num_blocks:
            raise RuntimeError("allocate the block tensors before building the stage-output cache")
        # the tensors may hold blocks past the pool's (CUDA graphs' null block: padding rows' K/V)
        if len(blocks) > block_tensors.num_blocks:
            raise ValueError(f"{len(blocks)} blocks for {block_tensors.num_blocks} block ids")
        self.block_tensors = block_tensors
        self.blocks = blocks  # the pool's blocks, by id: their current identity numbers
        self.block_size = block_size
        self._written_uid = [0] * len(blocks)  # identity each block's rows were written under (0: none)
        self.num_rows_written = 0
        self.num_rows_read = 0

    # -- validity ------------------------------------------------------------------------------
    def is_valid(self, block_id: int) -> bool:
        """The block's rows were written under the identity it holds now."""
        uid = self.blocks[block_id].uid
        return uid != 0 and self._written_uid[block_id] == uid

    def num_valid_prefix(self, blocks: Iterable[Any]) -> int:
        """How many leading blocks of `blocks` (KV blocks with `block_id`) have valid rows."""
        n = 0
        for block in blocks:
            if not self.is_valid(block.block_id):
                break
            n += 1
        return n

    def commit(self, block_ids: Iterable[int]) -> None:
        """Every row of these blocks has been written: they are readable under their current
        identity (blocks that are not cached - uid 0 - stay unreadable)."""
        blocks, written = self.blocks, self._written_uid
        for bid in block_ids:
            written[bid] = blocks[bid].uid

    def invalidate_all(self) -> None:
        self._written_uid = [0] * len(self.blocks)

    # -- rows ----------------------------------------------------------------------------------
    def _tensor(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        key = spec_name(name, dtype)
        if key not in self.block_tensors.specs:
            declared = ", ".join(n for n in self.block_tensors.specs if n.startswith("stage.")) or "none"
            raise ValueError(
                f"per-token output {name!r} ({dtype}) is not declared in the memory budget (declared: {declared})"
            )
        return self.block_tensors.ensure(key)

    def stage(self, outputs: Mapping[str, torch.Tensor], slot_mapping: torch.Tensor) -> StagedRows:
        """Row i of every output, for slot `slot_mapping[i]`, on its way to host memory (in stream
        order on a GPU; a copy on a CPU, as later steps may reuse the buffers): written into the
        cache by `StagedRows.write` when the step is booked."""
        return StagedRows(self, outputs, slot_mapping)

    @torch.inference_mode()
    def write(self, outputs: Mapping[str, torch.Tensor], slot_mapping: torch.Tensor) -> None:
        """Row i of every output goes to slot `slot_mapping[i]`."""
        slots = slot_mapping.cpu()
        for name, rows in outputs.items():
            cache = self._tensor(name, rows.dtype)
            flat = cache.view(-1, *cache.shape[2:])
            flat.index_copy_(0, slots, rows.detach().to("cpu", non_blocking=False))
            self.num_rows_written += len(slots)

    def read(
        self,
        block_ids: Sequence[int],
        dtype: torch.dtype,
        name: str = HIDDEN_STATES,
        device: torch.device | None = None,
    ) -> torch.Tensor:
        """The rows of whole blocks, `(len(block_ids) * block_size, D)` in order, on `device`
        (default: the host). Raises if any block's rows are not valid now: a stale read is a bug,
        never a result. To a GPU they go through page-locked memory in stream order (`to_device`),
        so the host waits for nothing (a copy from ordinary memory would wait for the steps in
        flight)."""
        stale = [bid for bid in block_ids if not self.is_valid(bid)]
        if stale:
            raise RuntimeError(f"stage-output rows of blocks {stale[:5]} are not valid (evicted, reused or unwritten)")
        cache = self._tensor(name, dtype)
        rows = cache[torch.tensor(list(block_ids), dtype=torch.long)]
        if device is not None:
            rows = to_device(rows, device)
        self.num_rows_read += rows.shape[0] * rows.shape[1]
        return rows.reshape(-1, *cache.shape[2:])


class StagedRows:
    """A step's per-token outputs and their KV slots, copied towards host memory when the step
    was launched; `write` puts them in the cache (once the step is booked)."""

    __slots__ = ("_cache", "_names", "_copies")

    def __init__(
        self, cache: StageOutputCache, outputs: Mapping[str, torch.Tensor], slot_mapping: torch.Tensor
    ) -> None:
        self._cache = cache
        self._names = list(outputs)
        tensors = [t.detach() for t in outputs.values()] + [slot_mapping]
        if not tensors[0].is_cuda:
            tensors = [t.clone() for t in tensors]
        self._copies = HostCopies(tensors)

    def write(self) -> None:
        *rows, slots = self._copies.wait()
        self._cache.write(dict(zip(self._names, rows)), slots)
