from __future__ import annotations

from typing import Any

from .identity import BlockKey


class KVCacheBlock:
    """One physical KV block. All of them are created once, with the pool.

    `block_key` is the block's exact identity while it is cached (identity.BlockKey: parent
    identity number, token tuple, extra keys - a key, not a hash), None otherwise. `uid` numbers
    identities: blocks holding the same identity share it, and a number is never handed out
    twice, so a child key that names an evicted parent can never match again. `content_hash` is
    the external identity (bytes), set only when something consumes it (KV events).
    The two links make the default policy's free queue intrusive: no wrapper objects, O(1)
    removal from the middle.
    """

    __slots__ = (
        "block_id",
        "ref_cnt",
        "block_key",
        "uid",
        "content_hash",
        "group_idx",
        "prev_free_block",
        "next_free_block",
        "policy_data",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_key: BlockKey | None = None
        self.uid = 0
        self.content_hash: bytes | None = None
        self.group_idx = 0  # the KV-cache group of the identity `content_hash` names (sliding_window.py)
        # KVCacheBlock or None; typed Any because LRUPolicy follows them without checks: a block in
        # the free queue always has both (sentinels at the ends), one outside it has neither.
        self.prev_free_block: Any = None
        self.next_free_block: Any = None
        self.policy_data: Any = None  # free for eviction policies that keep per-block state

    @property
    def is_cached(self) -> bool:
        return self.block_key is not None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_key is not None})"
