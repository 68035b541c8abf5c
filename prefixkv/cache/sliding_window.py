"""The later KV-cache groups of a hybrid model (vLLM's SlidingWindowManager and its
FullAttentionManager for the groups after the first).

A model whose layers mix full attention and sliding-window attention (Gemma 2 / 3, Qwen2 with
`max_window_layers`, gpt-oss) keeps its layers in KV-cache groups of equal size: group 0 holds
full-attention layers, each later group more full-attention layers or some of the sliding ones.
Every group has its own block table per request, and a block id names a slot in one group's
layers only, so a block costs the memory of one group's layers rather than every layer's.

Group 0 keeps every block of a request, as any full-attention model does, and its blocks carry the
prefix's identity (manager.py). A sliding group needs only the blocks holding the last `window`
positions: the blocks before them are released while the request runs (they stay cached, as any
freed block does, until the pool reuses them), and its entries become None. A sliding group's
block at index i is cached under the identity of group 0's block i - (its identity number, the
group's marker, the block's extra keys) - so it is found exactly as the prefix is, and a block
whose group-0 block was evicted can never be hit again.

A prefix hit is the longest prefix that every group can serve: group 0's cached blocks, cut back
until each sliding group has the blocks of the window at the hit's end (`longest_hit`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .block import KVCacheBlock
from .identity import BlockKey, ExtraKeys

# A group's table of one request: a block per block index, None where it was released (out of the
# window) or never needed (before the window of a hit).
GroupTable = list[KVCacheBlock | None]


def group_key(anchor_uid: int, group: int, extra: ExtraKeys | None) -> BlockKey:
    """The identity of sliding group `group`'s block behind group 0's block `anchor_uid`. The token
    field holds the group's marker, (-group,): a real block's tokens are block_size token ids, none
    negative, so the key can never be a group-0 key, and the extra keys stay where the pool reads
    them (an unloaded adapter's blocks are found in every group)."""
    return (anchor_uid, (-group,), extra)


class SlidingWindowGroups:
    """Groups 1.. of a hybrid KV cache: `windows[g - 1]` is group g's sliding window in tokens, or
    None for a group of full-attention layers (it keeps every block, as group 0 does)."""

    def __init__(self, windows: Sequence[int | None], block_size: int) -> None:
        if not windows:
            raise ValueError("a hybrid KV cache needs at least one group after group 0")
        for w in windows:
            if w is not None and w < 1:
                raise ValueError(f"a sliding window must be at least one token, got {w}")
        self.windows = tuple(windows)
        self.block_size = block_size
        self.groups = range(1, len(windows) + 1)

    def __len__(self) -> int:
        return len(self.windows)

    def window(self, group: int) -> int | None:
        return self.windows[group - 1]

    def first_needed_block(self, group: int, num_computed_tokens: int) -> int:
        """The first block a group still reads when the next token computed is at position
        `num_computed_tokens`: a query at p sees keys from p - window + 1 on (all of them in a
        full-attention group)."""
        window = self.windows[group - 1]
        if window is None:
            return 0
        return max(0, num_computed_tokens - window + 1) // self.block_size

    def longest_hit(
        self,
        anchors: list[KVCacheBlock],
        extra: Callable[[int], ExtraKeys | None],
        get_one_block: Callable[[BlockKey], KVCacheBlock | None],
    ) -> tuple[int, list[GroupTable]]:
        """The longest h <= len(anchors) whose window every group holds cached, and each group's
        table for it (None before its window). `extra(i)`: block i's extra keys."""
        h = len(anchors)
        found: dict[tuple[int, int], KVCacheBlock | None] = {}

        def cached(g: int, i: int) -> KVCacheBlock | None:
            k = (g, i)
            if k not in found:
                found[k] = get_one_block(group_key(anchors[i].uid, g, extra(i)))
            return found[k]

        while h > 0:
            missing = -1
            for g in self.groups:
                lo = self.first_needed_block(g, h * self.block_size)
                for i in range(h - 1, lo - 1, -1):
                    if cached(g, i) is None:
                        missing = i
                        break
                if missing >= 0:
                    break
            if missing < 0:
                break
            # every h' in (missing, h] needs block `missing` too (its window starts no later)
            h = missing
        tables: list[GroupTable] = []
        for g in self.groups:
            lo = self.first_needed_block(g, h * self.block_size)
            table: GroupTable = [None] * lo
            table.extend(found[(g, i)] for i in range(lo, h))
            tables.append(table)
        return h, tables

    def release_out_of_window(
        self, tables: list[GroupTable], first_live: list[int], num_computed: int
    ) -> list[KVCacheBlock]:
        """Take out of `tables` the blocks no query from position `num_computed` on reads; returns
        them, later ones first (the order to free them in). `first_live[g - 1]`: where the last
        release stopped (updated)."""
        released: list[KVCacheBlock] = []
        for g in self.groups:
            table = tables[g - 1]
            lo = min(self.first_needed_block(g, num_computed), len(table))
            for i in range(lo - 1, first_live[g - 1] - 1, -1):
                block = table[i]
                if block is not None:
                    released.append(block)
                    table[i] = None
            first_live[g - 1] = max(first_live[g - 1], lo)
        return released
