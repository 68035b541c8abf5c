"""Pinned prefixes: cached blocks an operator or tenant asked to keep.

A pin is one more holder of each block of a cached prefix (the pool's reference count), so a
pinned block is never free and no eviction policy ever sees it: pinning needs no policy's
cooperation and costs the hot path nothing. Pins are named by the identity of the prefix's last
block (its `uid`, never reused): pinning the same prefix twice is one pin, and a tenant can only
reach its own pins - its cache salt is part of every block's identity, so another tenant's
lookup of the same text finds other blocks (or none). Their blocks are bounded by a share of the
pool; a pin past it is refused, never silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from .block import KVCacheBlock


class PinError(ValueError):
    """A pin that cannot be taken (nothing cached, or past the pool's pin bound)."""


@dataclass(frozen=True)
class Pin:
    """One pinned prefix: its blocks in order and the tenant (cache salt) it belongs to."""

    blocks: tuple[KVCacheBlock, ...]
    cache_salt: str | None
    num_tokens: int
    # a hybrid model's sliding-window groups: their blocks inside the window at the prefix's end,
    # held beside it so that a hit on the whole prefix stays possible (sliding_window.py)
    window_blocks: tuple[KVCacheBlock, ...] = ()

    @property
    def held(self) -> tuple[KVCacheBlock, ...]:
        """Every block the pin holds."""
        return self.blocks + self.window_blocks if self.window_blocks else self.blocks


class PinnedPrefixes:
    """The pins of one pool: at most `max_blocks` distinct blocks pinned at once."""

    def __init__(self, num_blocks: int, max_fraction: float) -> None:
        if not 0.0 <= max_fraction <= 1.0:
            raise ValueError(f"the pinned share of the KV cache must be in [0, 1], got {max_fraction}")
        self.max_fraction = max_fraction
        # one block stays unpinnable: a request must always be able to make progress
        self.max_blocks = min(int(num_blocks * max_fraction), num_blocks - 1)
        self._pins: dict[int, Pin] = {}  # uid of the prefix's last block -> its pin
        self._holds: dict[int, int] = {}  # block id -> number of pins holding it

    def __len__(self) -> int:
        return len(self._pins)

    @property
    def num_pinned_blocks(self) -> int:
        """Distinct blocks held by at least one pin."""
        return len(self._holds)

    def get(self, leaf: KVCacheBlock) -> Pin | None:
        return self._pins.get(leaf.uid)

    def holds(self, block_id: int) -> int:
        """How many pins hold the block (0: none)."""
        return self._holds.get(block_id, 0)

    def check_room(self, blocks: list[KVCacheBlock]) -> None:
        """Raise PinError when pinning `blocks` would pass the bound."""
        new = sum(1 for b in blocks if b.block_id not in self._holds)
        if self.num_pinned_blocks + new > self.max_blocks:
            raise PinError(
                f"pinning {len(blocks)} blocks ({new} not pinned yet) would pin "
                f"{self.num_pinned_blocks + new} of the KV cache's blocks, past the bound of {self.max_blocks} "
                f"({self.max_fraction:.0%} of the pool; raise it with --max-pinned-fraction or unpin a prefix)"
            )

    def add(
        self,
        blocks: list[KVCacheBlock],
        cache_salt: str | None,
        num_tokens: int,
        window_blocks: list[KVCacheBlock] | None = None,
    ) -> Pin:
        pin = Pin(tuple(blocks), cache_salt, num_tokens, tuple(window_blocks or ()))
        self._pins[blocks[-1].uid] = pin
        for block in pin.held:
            self._holds[block.block_id] = self._holds.get(block.block_id, 0) + 1
        return pin

    def remove(self, leaf: KVCacheBlock) -> Pin | None:
        pin = self._pins.pop(leaf.uid, None)
        if pin is not None:
            self._release(pin)
        return pin

    def remove_all(self, cache_salt: str | None = None, every_tenant: bool = True) -> list[Pin]:
        """Drop every pin (of one tenant when `every_tenant` is False); returns them."""
        gone = [u for u, p in self._pins.items() if every_tenant or p.cache_salt == cache_salt]
        pins = [self._pins.pop(u) for u in gone]
        for pin in pins:
            self._release(pin)
        return pins

    def _release(self, pin: Pin) -> None:
        for block in pin.held:
            left = self._holds[block.block_id] - 1
            if left:
                self._holds[block.block_id] = left
            else:
                del self._holds[block.block_id]

    def pins(self) -> list[Pin]:
        return list(self._pins.values())
