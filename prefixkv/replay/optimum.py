"""Belady's offline optimum for prefix caching, over the same schedule and capacity as the replay.

What it computes. The run uses `simulator.run_schedule` - the same FCFS admission, hold times,
output reservation, lookup rule (whole blocks, at most input_length - 1 tokens) and block
accounting as the real manager (a cache hit on an unheld block uses one free block; blocks held
by running requests are shared and cannot be evicted). Only the choice of victim differs, and it
uses the future: a free block without identity is always taken first (costs nothing); otherwise
the free cached block whose next use is farthest in the future is evicted, ties broken deepest
prefix first. The "next use" of a block is the next request, in admission order (= trace order,
since admission is FCFS), that references that exact prefix block, if the block lies in that
request's lookup range; if it lies beyond it (e.g. the last full block of a prompt whose length
is a multiple of the block size), that request recomputes the block whatever is cached, so a copy
kept until then is worthless and the block counts as never used again; and when a request
recomputes a block of which a free cached copy exists, that copy becomes a plain free block (the
new copy carries the identity on). A request's own copy of a block that another running request
holds is cached too, as in the manager: redundant while another copy lives, it carries the
identity on when it is the last. Without these three rules the bound was beaten by LFU and by
ghost-credit on randomized small traces (a block re-created by a request that cannot look it up
was kept at the expense of one that was later hit). A block is only
useful with its whole prefix, and every request that can use a block can use its parent, so the
parent's next use is never later than the child's; with the depth tie-break the cache therefore
stays prefix-closed (a child is always evicted before its parent) and no block is orphaned.

Why it is a bound, and where it is not exact. With unit-size blocks, one reference at a time and
fixed free capacity, farthest-next-use is optimal (Belady/Mattson). Here a request references a
chain of blocks at once, the free capacity varies with the blocks running requests hold, and the
admission times can shift with the memory that sharing saves; under those conditions the rule is
not proven optimal, so call it a strong heuristic bound, not a theorem. It is checked to be >=
every online policy on random small traces (tests/replay) and in every sweep. The hard ceiling,
independent of capacity, is `infinite_cache_hit_rate` (only compulsory misses).
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Sequence

from .simulator import ReplayResult, TimeModel, run_schedule
from .trace import TraceRequest


class BlockIndex:
    """Every full prompt block of the trace as a node of the prefix trie (node = exact prefix,
    keyed by (parent node, block tokens) like the manager's exact keys), with each node's uses:
    the request indices whose lookup range (first (input_length - 1) // block_size blocks)
    contains it."""

    def __init__(self, trace: Sequence[TraceRequest], block_size: int) -> None:
        self.block_size = block_size
        keys: dict[tuple, int] = {}
        self.nodes: list[list[int]] = []
        self.caps: list[int] = []
        uses: list[list[int]] = []
        refs: list[list[int]] = []  # every request that computes or looks up the node
        bs = block_size
        for idx, req in enumerate(trace):
            tokens = req.prompt_token_ids()
            num_full = len(tokens) // bs
            cap = (len(tokens) - 1) // bs
            chain = []
            parent = -1
            for b in range(num_full):
                key = (parent, tuple(tokens[b * bs : (b + 1) * bs]))
                node = keys.get(key)
                if node is None:
                    node = keys[key] = len(uses)
                    uses.append([])
                    refs.append([])
                if b < cap:
                    uses[node].append(idx)
                refs[node].append(idx)
                chain.append(node)
                parent = node
            self.nodes.append(chain)
            self.caps.append(cap)
        self.uses = uses
        self.refs = refs

    def infinite_cache_hits(self) -> tuple[int, int]:
        """(hit tokens, prompt tokens) with a cache that never evicts: compulsory misses only."""
        seen: set[int] = set()
        hits = 0
        for chain, cap in zip(self.nodes, self.caps):
            h = 0
            while h < cap and chain[h] in seen:
                h += 1
            hits += h * self.block_size
            seen.update(chain)
        return hits, 0


class BeladyBackend:
    last_tier_hit = 0  # no tier below the pool here

    def __init__(self, index: BlockIndex, num_blocks: int, skipped: Sequence[bool]) -> None:
        self.num_blocks = num_blocks
        self.ix = index
        self.skipped = skipped  # requests larger than the pool never run: they use nothing
        self.ref: dict[int, int] = {}  # cached node -> holders (> 0)
        self.free_cached: dict[int, int] = {}  # cached node nobody holds -> its heap stamp
        self.heap: list[tuple] = []  # (rank, -depth, stamp, node); rank = -next use here
        self.free_plain = num_blocks  # free blocks without identity
        # request -> ((depth, node) it holds, plain blocks it holds, (depth, node) of its duplicates)
        self.live: dict[int, tuple[list[tuple[int, int]], int, list[tuple[int, int]]]] = {}
        self.dup_holders: dict[int, list[int]] = {}  # node -> running requests holding a duplicate copy
        self.last_admitted = -1
        self._stamp = 0
        self._evictions = 0

    def admit(self, index: int, req: TraceRequest, lookahead: int) -> int | None:
        ix = self.ix
        chain, cap = ix.nodes[index], ix.caps[index]
        ref, free_cached = self.ref, self.free_cached
        h = 0
        while h < cap and (chain[h] in ref or chain[h] in free_cached):
            h += 1
        bs = ix.block_size
        required = -(-(req.input_length + lookahead) // bs)
        num_new = required - h
        evictable_hits = sum(1 for node in chain[:h] if node in free_cached)
        if num_new + evictable_hits > self.free_plain + len(free_cached):
            return None
        self.last_admitted = index
        for node in chain[:h]:
            if node in free_cached:
                del free_cached[node]  # its heap entry goes stale
            ref[node] = ref.get(node, 0) + 1
        for node in chain[h:]:
            if node in free_cached:
                # Recomputed by this request (beyond its hit prefix): the free copy is worth
                # nothing from now on, since this request's copy takes over the identity, so it
                # is the first victim (as a plain block). The manager keeps both copies; keeping
                # a worthless one can only cost the optimum.
                del free_cached[node]
                self.free_plain += 1
                self._evictions += 1
        take_plain = min(num_new, self.free_plain)
        self.free_plain -= take_plain
        for _ in range(num_new - take_plain):
            self._evict_one()
        held = list(enumerate(chain[:h]))  # (depth, node) of every identity it holds
        dups: list[tuple[int, int]] = []  # (depth, node): its own copy of a block another running request holds
        plain = required - h
        for depth in range(h, len(chain)):
            node = chain[depth]
            if node in ref:
                dups.append((depth, node))
                self.dup_holders.setdefault(node, []).append(index)
                continue
            ref[node] = 1
            held.append((depth, node))
            plain -= 1
        self.live[index] = (held, plain, dups)
        return h * bs

    def _evict_one(self) -> None:
        heap, free_cached = self.heap, self.free_cached
        while True:
            _, _, stamp, node = heapq.heappop(heap)
            if free_cached.get(node) == stamp:
                del free_cached[node]
                self._evictions += 1
                return

    def release(self, index: int) -> None:
        held, plain, dups = self.live.pop(index)
        ref, free_cached = self.ref, self.free_cached
        self.free_plain += plain
        for depth, node in reversed(held):
            r = ref[node] - 1
            if r:
                ref[node] = r
            elif self.dup_holders.get(node):
                # A running request holds its own copy: that copy carries the identity on (held:
                # a hit for whoever looks the block up, never evicted), and this one is redundant,
                # a plain free block. Freed as a cached block instead, it was evicted before a
                # later request could hit the copy still held, which an online policy did hit.
                heirs = self.dup_holders[node]
                heir = heirs.pop(0)
                if not heirs:
                    del self.dup_holders[node]
                heir_held, heir_plain, heir_dups = self.live[heir]
                heir_dups.remove((depth, node))
                heir_held.append((depth, node))
                self.live[heir] = (heir_held, heir_plain - 1, heir_dups)
                self.free_plain += 1
            else:
                del ref[node]
                self._free_node(node, depth)
        # A duplicate copy is cached too (the manager keeps every copy): it is redundant while
        # another copy lives, and carries the identity on when none does.
        for depth, node in reversed(dups):
            holders = self.dup_holders.get(node)
            if holders is not None and index in holders:  # not promoted to carry the identity
                holders.remove(index)
                if not holders:
                    del self.dup_holders[node]
            if node not in ref and node not in free_cached:
                self.free_plain -= 1
                self._free_node(node, depth)

    def _free_node(self, node: int, depth: int) -> None:
        self._stamp += 1
        self.free_cached[node] = self._stamp
        heapq.heappush(self.heap, (self._rank(self._next_use(node)), -depth, self._stamp, node))

    def _next_use(self, node: int) -> int:
        """The next request that references the node: if it can look the node up, that is the
        next use; if not (the node lies beyond its lookup range) it recomputes the node anyway,
        so the copy kept until then is worth nothing: never used (= number of requests)."""
        refs, uses, skipped = self.ix.refs[node], self.ix.uses[node], self.skipped
        last = self.last_admitted
        k = bisect_right(refs, last)
        while k < len(refs) and skipped[refs[k]]:
            k += 1
        if k < len(refs):
            j = bisect_right(uses, last)
            while j < len(uses) and skipped[uses[j]]:
                j += 1
            if j < len(uses) and uses[j] == refs[k]:
                return refs[k]
        return len(self.ix.nodes)

    def _rank(self, next_use: int) -> int | tuple[int, int]:
        """Heap order of a freed block (smallest evicted first): farthest next use first."""
        return -next_use

    def blocks_in_use(self) -> int:
        return self.num_blocks - self.free_plain - len(self.free_cached)

    def evictions(self) -> int:
        return self._evictions


class ReuseOracleBackend(BeladyBackend):
    """Not a bound, a yardstick for online policies: it knows only whether a freed block will
    ever be used again, not when. Dead blocks are evicted first, then the LRU order. Any
    policy that predicts reuse (as `predicted-reuse` does) can at best match a perfect
    predictor's ranking; the gap between this and the optimum is what knowing *when* is worth."""

    def _rank(self, next_use: int) -> tuple[int, int]:
        return (0 if next_use == len(self.ix.nodes) else 1, self._stamp)


def replay_optimum(
    trace: Sequence[TraceRequest],
    num_blocks: int,
    block_size: int = 512,
    time_model: TimeModel | None = None,
    index: BlockIndex | None = None,
    reuse_oracle: bool = False,
) -> ReplayResult:
    """Belady's offline optimum over the replay's schedule and capacity (see module docstring).
    Pass a prebuilt `index` to reuse it across cache sizes. `reuse_oracle=True` runs
    ReuseOracleBackend instead (knows whether, not when, a block returns)."""
    time_model = time_model or TimeModel()
    if index is None or index.block_size != block_size:
        index = BlockIndex(trace, block_size)
    skipped = [-(-time_model.footprint_tokens(r) // block_size) > num_blocks for r in trace]
    backend = (ReuseOracleBackend if reuse_oracle else BeladyBackend)(index, num_blocks, skipped)
    result = ReplayResult("reuse-oracle" if reuse_oracle else "optimum", num_blocks, block_size)
    run_schedule(trace, backend, block_size, time_model, result)
    if backend.blocks_in_use() != 0 or backend.ref:
        raise AssertionError("optimum replay leaked blocks")
    return result


def infinite_cache_hit_rate(
    trace: Sequence[TraceRequest], block_size: int = 512, index: BlockIndex | None = None
) -> float:
    """Hit rate with unlimited capacity (only first uses miss): the ceiling of every policy."""
    if index is None or index.block_size != block_size:
        index = BlockIndex(trace, block_size)
    hits, _ = index.infinite_cache_hits()
    total = sum(r.input_length for r in trace)
    return hits / total if total else 0.0
