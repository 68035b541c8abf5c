"""KVCacheManager: the scheduler's view of the KV cache - lookups, allocation, freeing."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from .block import KVCacheBlock
from .events import FULL_ATTENTION, MEDIUM_POOL, SLIDING_WINDOW, BlockStored, KVCacheEvent
from .eviction import EvictionPolicy, get_policy, overrides
from .identity import ROOT_UID, BlockChain, ExtraKeys, HashFunction, get_hash_function, none_hash
from .pins import Pin, PinError, PinnedPrefixes
from .pool import BlockPool
from .protocol import CacheRequest
from .residency import ResidencyMetrics
from .sliding_window import GroupTable, SlidingWindowGroups, group_key
from .stats import PrefixCacheStats

# shared by every request of a one-group cache (never appended to)
_NO_GROUPS: list[GroupTable] = []


class _RequestBlocks:
    __slots__ = ("chain", "blocks", "block_ids", "num_cached_blocks", "groups", "first_live", "group_ids")

    def __init__(self, chain: BlockChain) -> None:
        self.chain = chain
        self.blocks: list[KVCacheBlock] = []  # the block table, append-only
        self.block_ids: list[int] = []  # its ids, kept beside it: read for every request every step
        self.num_cached_blocks = 0  # leading blocks already entered in the table
        # a hybrid model's later KV-cache groups (sliding_window.py): a table each, None where
        # released, and where each group's live blocks begin
        self.groups = _NO_GROUPS
        self.first_live: list[int] = []
        # the groups' block ids as get_group_block_ids hands them out, until a table changes (None)
        self.group_ids: list[list[int]] | None = None


class KVCacheManager:
    """Prefix-cached block allocation for requests (docs/design.md, "Lookup, allocation, free").

    Keyword options beyond the acceptance surface:
      hash_algo     content hash for external identity: "sha256_cbor" (default), "sha256",
                    "xxhash_cbor", or a callable(obj) -> bytes. It never decides a local hit.
      hash_seed     seed of NONE_HASH (and of xxhash), fixed so hashes agree across processes.
      eviction_policy  name or EvictionPolicy subclass (default "lru", vLLM's order; the
                    names are prefixkv.cache.POLICIES).
      enable_kv_cache_events  record BlockStored / BlockRemoved / AllBlocksCleared, to be drained
                    with take_events().
      max_pending_kv_events  bound on events not yet taken: beyond it the oldest is dropped and
                    counted in num_dropped_kv_events.
      max_pinned_fraction  share of the blocks that pins may hold (pins.py); a pin past it is
                    refused with PinError.
      residency     sampled residency metrics (residency.py; vLLM's --kv-cache-metrics), None: off.
      group_windows  a hybrid model's KV-cache groups after group 0 (full-attention layers): each
                    one's sliding window in tokens, None for more full-attention layers
                    (sliding_window.py); empty: one group.
      group_kind    what group 0's blocks hold, in vLLM's kv_cache_spec_kind names for the events:
                    "full_attention" (K/V rows kept as full attention keeps them) or "mamba" (a
                    recurrent model's state after each block).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_caching: bool = True,
        *,
        hash_algo: str | HashFunction = "sha256_cbor",
        hash_seed: int | None = None,
        eviction_policy: str | type[EvictionPolicy] = "lru",
        enable_kv_cache_events: bool = False,
        max_pending_kv_events: int = 10_000,
        max_pinned_fraction: float = 0.5,
        residency: ResidencyMetrics | None = None,
        group_windows: Sequence[int | None] = (),
        group_kind: str = FULL_ATTENTION,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_fn = get_hash_function(hash_algo, hash_seed)
        self.none_hash = none_hash(self.hash_fn, 0 if hash_seed is None else hash_seed)
        self.block_pool = BlockPool(
            num_blocks,
            enable_caching,
            get_policy(eviction_policy),
            enable_kv_cache_events,
            max_pending_kv_events,
            residency,
        )
        self.residency = residency
        self.sliding = SlidingWindowGroups(group_windows, block_size) if group_windows else None
        self.group_kind = group_kind
        self.pins = PinnedPrefixes(num_blocks, max_pinned_fraction)
        self.stats = PrefixCacheStats()
        self._requests: dict[str, _RequestBlocks] = {}
        # Only a policy that learns from finished requests overrides on_request_free; for the
        # others (the default among them) free() does not even read the request's token counts.
        policy = self.block_pool.eviction_policy
        self._on_request_free = policy.on_request_free if overrides(policy, "on_request_free") else None
        self._on_request_priority = policy.on_request_priority if overrides(policy, "on_request_priority") else None

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached free blocks count as free)."""
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        state = self._requests.get(request_id)
        return list(state.block_ids) if state is not None else []

    def num_blocks_held(self, request_id: str) -> int:
        """len(get_block_ids(request_id)), without the copy (asked per request per step)."""
        state = self._requests.get(request_id)
        return len(state.block_ids) if state is not None else 0

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        """The block ids of the request's sliding-window groups (1, 2, ...): 0 where a block was
        released (never read: it is out of every query's window); [] without such groups. The
        same lists until a table changes (a block added or released; read them, never edit them):
        a step's consumers tell a changed table by its identity."""
        if self.sliding is None:  # asked for every request every step: no lookup where none exist
            return []
        state = self._requests.get(request_id)
        if state is None:
            return []
        if state.group_ids is None:
            state.group_ids = [[0 if b is None else b.block_id for b in table] for table in state.groups]
        return state.group_ids

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        state = self._requests.get(request_id)
        return list(state.blocks) if state is not None else []

    def get_block_hashes(self, request: CacheRequest) -> list[bytes]:
        """Content hashes of the request's full blocks (computed incrementally, once each)."""
        state = self._state(request)
        n = state.chain.extend(request)
        return list(state.chain.hashes_upto(n, self.hash_fn, self.none_hash))

    def get_block_chain(self, request: CacheRequest) -> BlockChain:
        """The request's identity material (tokens and extra keys of its full blocks), extended."""
        state = self._state(request)
        state.chain.extend(request)
        return state.chain

    def _state(self, request: CacheRequest) -> _RequestBlocks:
        state = self._requests.get(request.request_id)
        if state is None:
            state = _RequestBlocks(BlockChain(self.block_size, request))
            if self.sliding is not None:
                state.groups = [[] for _ in self.sliding.groups]
                state.first_live = [0] * len(self.sliding)
            self._requests[request.request_id] = state
        return state

    # -- lookup --------------------------------------------------------------------------------
    def get_computed_blocks(self, request: CacheRequest, record_stats: bool = True) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of whole blocks, at most num_tokens - 1 tokens (the last token
        must be computed to produce logits). Changes nothing but the statistics; a scheduler
        that may look a waiting request up again passes record_stats=False and calls
        `stats.record` once the request is admitted, so retries are not counted twice."""
        if not self.enable_caching or request.num_computed_tokens > 0:
            return [], 0
        state = self._state(request)
        num_full = state.chain.extend(request)
        hits = self._cached_blocks(state.chain, min(num_full, (request.num_tokens - 1) // self.block_size))
        if self.sliding is not None and hits:  # as far as every group holds its window
            del hits[self._group_hits(state.chain, hits)[0] :]
        num_hit_tokens = len(hits) * self.block_size
        if record_stats:
            self.stats.record(request.num_tokens, num_hit_tokens, getattr(request, "num_preemptions", 0) > 0)
        return hits, num_hit_tokens

    # -- allocation ----------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: CacheRequest,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Give the request room for `num_new_tokens` more tokens after its computed ones (plus
        the cache hits in `new_computed_blocks`). Returns the newly allocated blocks, or None -
        changing nothing - when the pool cannot supply them. Blocks that will be full after this
        step are entered in the cache table at once."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if not new_computed_blocks and not num_new_computed_tokens and self.sliding is None:
            # the common decode step: the tokens fit in the blocks held, nothing to take
            held = self._requests.get(request.request_id)
            if held is not None:
                num_tokens_after = request.num_computed_tokens + num_new_tokens
                if num_tokens_after + num_lookahead_tokens <= len(held.blocks) * self.block_size:
                    if self.enable_caching:
                        self._cache_full_blocks(
                            request, held, min(num_tokens_after, request.num_tokens) // self.block_size
                        )
                    return []
        new_computed_blocks = new_computed_blocks or []
        if num_new_computed_tokens is None:
            num_new_computed_tokens = len(new_computed_blocks) * self.block_size
        state = self._state(request)
        if new_computed_blocks and state.blocks:
            raise ValueError(
                f"request {request.request_id} already holds blocks; cache hits "
                "are only taken by a request that holds none"
            )
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_after = num_computed + num_new_tokens
        bs = self.block_size
        num_required = -(-(num_tokens_after + num_lookahead_tokens) // bs)
        num_new_blocks = num_required - len(state.blocks) - len(new_computed_blocks)
        num_new_blocks = max(num_new_blocks, 0)
        num_evictable_hits = 0
        for block in new_computed_blocks:
            if block.ref_cnt == 0:
                num_evictable_hits += 1
        pool = self.block_pool
        group_hits: list[GroupTable] = []
        num_group_blocks = 0
        if self.sliding is not None:
            if state.blocks:  # blocks out of every window go back before new ones are taken
                self._release_out_of_window(state, request.num_computed_tokens)
            if new_computed_blocks:
                h, group_hits = self._group_hits(state.chain, new_computed_blocks)
                if h != len(new_computed_blocks):
                    if not state.blocks:
                        del self._requests[request.request_id]
                    raise ValueError("cache hits must be a prefix every KV-cache group holds (get_computed_blocks)")
                num_evictable_hits += sum(1 for t in group_hits for b in t if b is not None and b.ref_cnt == 0)
            num_group_blocks = num_new_blocks  # every group's table is as long as group 0's
        if num_new_blocks + num_group_blocks * len(state.groups) + num_evictable_hits > pool.num_free_blocks:
            if not state.blocks:
                del self._requests[request.request_id]  # nothing held: leave no trace
            return None

        if new_computed_blocks:
            pool.touch(new_computed_blocks)
            state.blocks.extend(new_computed_blocks)
            state.block_ids.extend([b.block_id for b in new_computed_blocks])
            state.num_cached_blocks = len(new_computed_blocks)
            if group_hits:
                state.group_ids = None
                for table, hit in zip(state.groups, group_hits):
                    pool.touch([b for b in hit if b is not None])
                    table.extend(hit)
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        state.blocks.extend(new_blocks)
        state.block_ids.extend([b.block_id for b in new_blocks])
        if num_group_blocks:
            state.group_ids = None
            for table in state.groups:
                table.extend(pool.get_new_blocks(num_group_blocks))

        if self.enable_caching:
            self._cache_full_blocks(request, state, min(num_tokens_after, request.num_tokens) // bs)
        return new_blocks

    def cache_full_blocks(self, request: CacheRequest, num_tokens: int) -> None:
        """Enter in the cache table the request's blocks that its first `num_tokens` tokens fill,
        where not entered yet. `allocate_slots` enters those a step will fill whose tokens are
        known; a step scheduled before its last token was known leaves that block to a later
        call - this one, or the next allocation."""
        state = self._requests.get(request.request_id)
        if state is None or not self.enable_caching:
            return
        num_tokens = min(num_tokens, request.num_tokens, len(state.blocks) * self.block_size)
        self._cache_full_blocks(request, state, num_tokens // self.block_size)

    def _cache_full_blocks(self, request: CacheRequest, state: _RequestBlocks, num_full: int) -> None:
        start = state.num_cached_blocks
        if num_full <= start:
            return
        chain = state.chain
        chain.extend(request)
        events = self.block_pool.events
        insert = self.block_pool.cached_blocks.insert
        blocks, tokens = state.blocks, chain.tokens
        parent = blocks[start - 1].uid if start else ROOT_UID
        for i in range(start, num_full):
            block = blocks[i]
            insert((parent, tokens[i], chain.extra(i)), block)
            parent = block.uid
        if state.groups:
            self._cache_group_blocks(state, start, num_full)
        state.num_cached_blocks = num_full
        if events is not None:
            events.append(self._stored_event(request, state, start, num_full))
            for g in range(1, len(state.groups) + 1):
                events.append(self._stored_event(request, state, start, num_full, g))

    def _cache_group_blocks(self, state: _RequestBlocks, start: int, num_full: int) -> None:
        """The later groups' blocks [start, num_full), under group 0's identities (sliding_window.py)."""
        insert, blocks, chain = self.block_pool.cached_blocks.insert, state.blocks, state.chain
        for g, table in enumerate(state.groups, 1):
            for i in range(start, num_full):
                member = table[i]
                if member is not None:
                    insert(group_key(blocks[i].uid, g, chain.extra(i)), member)

    def _stored_event(
        self, request: CacheRequest, state: _RequestBlocks, start: int, end: int, group: int = 0
    ) -> BlockStored:
        """Group `group`'s blocks [start, end) stored: every group's block i carries block i's hash
        (vLLM's rule: the groups are told apart by group_idx)."""
        hashes = state.chain.hashes_upto(end, self.hash_fn, self.none_hash)
        table = state.groups[group - 1] if group else state.blocks
        for i in range(start, end):
            block = table[i]
            if block is not None:  # the group goes with the hash: its BlockRemoved names it
                block.content_hash = hashes[i]
                block.group_idx = group
        event = self._describe(request, state.chain, hashes, start, end)
        if not group:
            return event
        assert self.sliding is not None
        window = self.sliding.window(group)
        return dataclasses.replace(
            event,
            group_idx=group,
            kv_cache_spec_kind=FULL_ATTENTION if window is None else SLIDING_WINDOW,
            kv_cache_spec_sliding_window=window,
        )

    def describe_blocks(self, request: CacheRequest, start: int, end: int, medium: str) -> BlockStored:
        """The BlockStored event of the request's full blocks [start, end) in another tier
        (`medium`): what a lower tier (prefixkv/tiers) publishes when it stores them."""
        chain = self.get_block_chain(request)
        hashes = chain.hashes_upto(end, self.hash_fn, self.none_hash)
        return self._describe(request, chain, hashes, start, end, medium)

    def _describe(
        self,
        request: CacheRequest,
        chain: BlockChain,
        hashes: Sequence[bytes],
        start: int,
        end: int,
        medium: str = MEDIUM_POOL,
    ) -> BlockStored:
        lora = request.lora_request
        token_ids = [t for block_tokens in chain.tokens[start:end] for t in block_tokens]
        return BlockStored(
            block_hashes=list(hashes[start:end]),
            parent_block_hash=hashes[start - 1] if start else None,
            token_ids=token_ids,
            block_size=self.block_size,
            lora_name=lora.lora_name if lora is not None else None,
            extra_keys=[chain.extra(i) for i in range(start, end)],
            # the integer id is not part of the cache protocol (the key is name, path, weights)
            lora_id=getattr(lora, "lora_int_id", None) if lora is not None else None,
            medium=medium,
            kv_cache_spec_kind=self.group_kind,
        )

    # -- release -------------------------------------------------------------------------------
    def free(self, request: CacheRequest) -> None:
        """Release the request's blocks, tail first: its last blocks carry the longest prefixes
        and are least likely to be shared, so they are evicted first."""
        state = self._requests.pop(request.request_id, None)
        if state is not None:
            if self._on_request_free is not None:
                self._on_request_free(request.num_prompt_tokens, request.num_output_tokens)
            if self._on_request_priority is not None:  # optional members of a request (prefixkv.request)
                self._on_request_priority(getattr(request, "cache_priority", getattr(request, "priority", 0)))
            if state.groups:  # position by position from the tail, every group's block before group 0's
                tail_first: list[KVCacheBlock] = []
                for i in range(len(state.blocks) - 1, -1, -1):
                    tail_first.extend(b for t in state.groups if i < len(t) and (b := t[i]) is not None)
                    tail_first.append(state.blocks[i])
                self.block_pool.free_blocks(tail_first)
            else:
                self.block_pool.free_blocks(reversed(state.blocks))

    def _group_hits(self, chain: BlockChain, anchors: list[KVCacheBlock]) -> tuple[int, list[GroupTable]]:
        assert self.sliding is not None
        return self.sliding.longest_hit(anchors, chain.extra, self.block_pool.cached_blocks.get_one_block)

    def _release_out_of_window(self, state: _RequestBlocks, num_computed_tokens: int) -> None:
        assert self.sliding is not None
        released = self.sliding.release_out_of_window(state.groups, state.first_live, num_computed_tokens)
        if released:
            state.group_ids = None
            self.block_pool.free_blocks(released)

    def evict_where(self, match: Callable[[ExtraKeys], bool]) -> tuple[int, int]:
        """Evict, first, the free cached blocks whose extra keys satisfy `match` (content that can
        never be hit again); returns (evicted, matching blocks still held by requests)."""
        return self.block_pool.evict_where(match)

    def reset_prefix_cache(self, keep_pinned: bool = False) -> bool:
        """Forget all cached identities. Only when idle: returns False while any block is held.
        Pins are dropped with them, unless `keep_pinned`: then the pinned prefixes stay cached
        (and blocks held by pins alone do not count as held)."""
        if keep_pinned:
            return self.block_pool.reset_prefix_cache(self.pins.holds)
        if not self.block_pool.held_only_by(self.pins.holds):
            return False  # held by requests: the pins stay too
        for pin in self.pins.remove_all():
            self.block_pool.free_blocks(reversed(pin.held))
        return self.block_pool.reset_prefix_cache()

    # -- pinned prefixes (pins.py) ---------------------------------------------------------------
    def cached_prefix(self, request: CacheRequest) -> list[KVCacheBlock]:
        """The cached blocks of the longest prefix of `request`'s full blocks (all of them may
        hit, unlike a lookup for computing); changes nothing."""
        return self._cached_prefix(request)[1]

    def _cached_prefix(self, request: CacheRequest) -> tuple[BlockChain, list[KVCacheBlock]]:
        chain = BlockChain(self.block_size, request)
        if not self.enable_caching:
            return chain, []
        return chain, self._cached_blocks(chain, chain.extend(request))

    def _cached_blocks(self, chain: BlockChain, max_blocks: int) -> list[KVCacheBlock]:
        """The cached blocks of the chain's first `max_blocks`, up to the first miss."""
        tokens, get_one_block = chain.tokens, self.block_pool.cached_blocks.get_one_block
        hits: list[KVCacheBlock] = []
        parent = ROOT_UID
        for i in range(max_blocks):
            block = get_one_block((parent, tokens[i], chain.extra(i)))
            if block is None:
                break
            hits.append(block)
            parent = block.uid
        return hits

    def pin(self, request: CacheRequest) -> Pin:
        """Keep the cached prefix of `request`'s full blocks cached until it is unpinned: none of
        its blocks is evicted meanwhile. Pinning a pinned prefix returns its pin. Raises PinError
        when none of it is cached (compute it first) or the pin would pass max_pinned_fraction.
        Only the prefix of `request`'s own tenant (cache salt), adapter and images is reachable."""
        chain, blocks = self._cached_prefix(request)
        if not blocks:
            raise PinError(
                f"nothing of this prefix ({request.num_tokens} tokens) is cached in whole blocks of "
                f"{self.block_size} tokens: compute it before pinning it"
            )
        pin = self.pins.get(blocks[-1])
        if pin is not None:
            return pin
        window: list[KVCacheBlock] = []
        if self.sliding is not None:  # what a hit on the whole prefix reads of the sliding groups
            _, tables = self._group_hits(chain, blocks)
            window = [b for t in tables for b in t if b is not None]
        self.pins.check_room(blocks + window)
        self.block_pool.touch(blocks + window)  # one more holder each: out of the policy's free set
        return self.pins.add(blocks, request.cache_salt, len(blocks) * self.block_size, window)

    def unpin(self, request: CacheRequest) -> Pin | None:
        """Release the pin of `request`'s cached prefix (the same prefix that was pinned, as the
        same tenant); None when there is none. Its blocks stay cached, evictable again."""
        blocks = self.cached_prefix(request)
        pin = self.pins.remove(blocks[-1]) if blocks else None
        if pin is not None:
            self.block_pool.free_blocks(reversed(pin.held))
        return pin

    def unpin_all(self, cache_salt: str | None = None, every_tenant: bool = True) -> int:
        """Release every pin (only `cache_salt`'s when `every_tenant` is False); returns how many."""
        pins = self.pins.remove_all(cache_salt, every_tenant)
        for pin in pins:
            self.block_pool.free_blocks(reversed(pin.held))
        return len(pins)

    # -- KV events -----------------------------------------------------------------------------
    def take_events(self) -> list[KVCacheEvent]:
        """Drain the pending KV events, oldest first ([] when enable_kv_cache_events is off). The
        engine takes them every step; at most max_pending_kv_events wait in between."""
        return self.block_pool.take_events()

    @property
    def num_dropped_kv_events(self) -> int:
        """Events dropped (oldest first) because more than max_pending_kv_events were pending."""
        return self.block_pool.num_dropped_events
