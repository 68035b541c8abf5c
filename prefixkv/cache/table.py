"""The cached-block table: exact identity -> the cached block(s) holding it."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from .block import KVCacheBlock
from .identity import ROOT_UID, BlockKey


class CachedBlockTable:
    """Exact identity -> the block(s) holding it. Block tables are append-only, so two requests
    that computed the same block both keep theirs (the "duplicated blocks" of vLLM's design document): an identity
    can be held by several blocks, which share its identity number (`uid`, handed out once per
    new identity and never reused - ROOT_UID is the parent of block 0).

    The first block entered for an identity is the one lookups return; the others wait in
    insertion order and the oldest takes its place when it is evicted. `get_one_block` is the
    hot-path lookup, a plain dict `get`."""

    __slots__ = ("_first", "_others", "_next_uid", "get_one_block")

    def __init__(self) -> None:
        self._first: dict[BlockKey, KVCacheBlock] = {}
        self._others: dict[BlockKey, dict[int, KVCacheBlock]] = {}  # duplicates, oldest first
        self._next_uid = ROOT_UID + 1
        self.get_one_block: Callable[[BlockKey], KVCacheBlock | None] = self._first.get

    def __len__(self) -> int:
        """Number of identities cached."""
        return len(self._first)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._first

    def get_blocks(self, key: BlockKey) -> list[KVCacheBlock]:
        """Every block holding `key`, the one lookups return first; [] when it is not cached."""
        first = self._first.get(key)
        if first is None:
            return []
        others = self._others.get(key)
        return [first] if others is None else [first, *others.values()]

    def items(self) -> Iterator[tuple[BlockKey, list[KVCacheBlock]]]:
        for key in self._first:
            yield key, self.get_blocks(key)

    def insert(self, key: BlockKey, block: KVCacheBlock) -> None:
        """Enter a full block under its exact identity: a new identity gets a new number, a
        duplicate shares the number of the blocks already holding it."""
        first = self._first.setdefault(key, block)  # one hash of the key
        if first is block:
            block.uid = self._next_uid
            self._next_uid += 1
        else:
            others = self._others.get(key)
            if others is None:
                self._others[key] = {block.block_id: block}
            else:
                others[block.block_id] = block
            block.uid = first.uid
        block.block_key = key

    def remove(self, block: KVCacheBlock) -> None:
        """A cached block is evicted: it leaves the table and loses its identity."""
        key = block.block_key
        assert key is not None, f"block {block.block_id} is not cached"
        first = self._first.pop(key)  # one hash of the key when it has no duplicate
        others = self._others.get(key) if self._others else None
        if others is not None:
            if first is block:  # the oldest duplicate takes its place
                first = others.pop(next(iter(others)))
            else:
                del others[block.block_id]
            self._first[key] = first
            if not others:
                del self._others[key]
        block.block_key = None
        block.uid = 0

    def clear(self) -> None:
        """Forget every identity (the blocks' own fields are the caller's). Identity numbers are
        not reused."""
        self._first.clear()  # in place: get_one_block is bound to it
        self._others.clear()
