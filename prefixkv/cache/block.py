from __future__ import annotations

from typing import Any


class KVCacheBlock:
    """One physical KV block. All of them are created once, with the pool.

    `block_hash` is the block's exact identity while it is cached (see identity.BlockKey), None
    otherwise. `uid` numbers identities: blocks holding the same identity share it, and a number is
    never handed out twice, so a child key that names an evicted parent can never match again.
    `content_hash` is the external identity (bytes), set only when something consumes it.
    The two links make the free queue intrusive: no wrapper objects, O(1) removal from the middle.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "uid", "content_hash",
                 "prev_free_block", "next_free_block", "policy_data")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: tuple | None = None
        self.uid = 0
        self.content_hash: bytes | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.policy_data: Any = None  # free for eviction policies that keep per-block state

    @property
    def is_cached(self) -> bool:
        return self.block_hash is not None

    def __repr__(self) -> str:
        return (f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, "
                f"cached={self.block_hash is not None})")
