"""How a hybrid model's attention layers share block tables and K/V tensors (vLLM's hybrid
KV-cache allocator, docs/design.md "KV-cache groups").

Layers of one kind (full attention, or one sliding window) are split into groups of `group_size`
layers, the same size for every group; each group has its own block table per request
(prefixkv/cache/sliding_window.py). The K/V tensors are shared across groups: tensor j holds
layer j of every group, so a block id, which belongs to one group at a time, costs the memory of
`group_size` layers. A sliding group releases the blocks out of its window while the request
runs; that is where the memory goes back.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model import ModelConfig


@dataclass(frozen=True)
class KVCacheGroups:
    """layers[g]: group g's layers (group 0: full-attention layers, whose blocks name the
    prefix); windows[g]: its sliding window in tokens, None for full attention."""

    layers: tuple[tuple[int, ...], ...]
    windows: tuple[int | None, ...]

    @property
    def group_size(self) -> int:
        return len(self.layers[0])

    @property
    def later_windows(self) -> tuple[int | None, ...]:
        """The windows of groups 1.. (what the cache manager is built with)."""
        return self.windows[1:]

    def layer_group(self, num_layers: int) -> list[int]:
        """Per layer, its group."""
        out = [0] * num_layers
        for g, layers in enumerate(self.layers):
            for layer in layers:
                out[layer] = g
        return out

    def layer_tensor(self, num_layers: int) -> list[int]:
        """Per layer, which K/V tensor holds it: its place in its group."""
        out = [0] * num_layers
        for layers in self.layers:
            for j, layer in enumerate(layers):
                out[layer] = j
        return out

    def blocks_for(self, num_tokens: int, chunk_tokens: int, block_size: int) -> int:
        """The most blocks a request of `num_tokens` holds at once when computed in chunks of at
        most `chunk_tokens`: every block in a full group; in a sliding group the window before a
        chunk plus the chunk (what the cache manager keeps, sliding_window.py)."""
        every = -(-num_tokens // block_size)
        total = 0
        for window in self.windows:
            if window is None:
                total += every
            else:
                total += min(every, (window - 1 + chunk_tokens) // block_size + 2)
        return total

    def max_tokens(self, num_blocks: int, chunk_tokens: int, block_size: int) -> int:
        """The longest request that `num_blocks` blocks hold (a multiple of block_size)."""
        lo, hi = 0, num_blocks  # in blocks of tokens; blocks_for is monotonic in num_tokens
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks_for(mid * block_size, chunk_tokens, block_size) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo * block_size


def plan_kv_groups(config: ModelConfig) -> KVCacheGroups | None:
    """The groups of a model with both full-attention and sliding-window layers; None for any
    other (one group: every block holds every layer). The group size is the smaller kind's
    count, as vLLM chooses it, so neither kind pads much."""
    if config.is_recurrent or not config.uniform_kv_layers:  # (a group's tensors hold one shape)
        return None
    windows = config.layer_windows
    full = [i for i, w in enumerate(windows) if w is None]
    by_window: dict[int, list[int]] = {}
    for i, w in enumerate(windows):
        if w is not None:
            by_window.setdefault(w, []).append(i)
    if not full or not by_window:
        return None
    size = min([len(full), *(len(layers) for layers in by_window.values())])
    layers: list[tuple[int, ...]] = []
    group_windows: list[int | None] = []
    for window, members in [(None, full), *by_window.items()]:
        for k in range(0, len(members), size):
            layers.append(tuple(members[k : k + size]))
            group_windows.append(window)
    return KVCacheGroups(tuple(layers), tuple(group_windows))
