"""Which prefixes `prefixkv replay --pin-top N` pins: the prefixes an operator would name - the
system prompts and documents many requests of the trace start with.

Requests are grouped by their first block; a group's prefix is the longest run of whole blocks all
of its requests share (a system prompt: every conversation that opens with it repeats it). The N
groups that would save the most - requests x shared blocks - are pinned, each when its first
request is admitted (its blocks are cached then), and stay pinned to the end. The choice looks at
the whole trace, as an operator who knows their system prompts would; it is an upper bound on
what naming them buys, not a policy that learns.
"""

from __future__ import annotations

from collections.abc import Sequence

from .trace import TraceRequest


def hot_prefixes(trace: Sequence[TraceRequest], block_size: int, top: int) -> list[tuple[int, ...]]:
    """Token ids of the `top` prefixes to pin (whole blocks, each shared by at least two requests
    that start with the same block), the most valuable first."""
    if top < 1:
        return []
    groups: dict[tuple[int, ...], tuple[list[int], int]] = {}  # first block -> (shared tokens, requests)
    for req in trace:
        ids = req.prompt_token_ids()
        if len(ids) < block_size:
            continue
        first = tuple(ids[:block_size])
        entry = groups.get(first)
        if entry is None:
            groups[first] = (ids[: len(ids) // block_size * block_size], 1)
            continue
        shared, count = entry
        n = 0
        limit = min(len(shared), len(ids))
        while n < limit and shared[n] == ids[n]:
            n += 1
        groups[first] = (shared[: n // block_size * block_size], count + 1)
    ranked = sorted(
        ((count * len(shared), tuple(shared)) for shared, count in groups.values() if count > 1 and shared),
        key=lambda item: -item[0],
    )
    return [prefix for _, prefix in ranked[:top]]
