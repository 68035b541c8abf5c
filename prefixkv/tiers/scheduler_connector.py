"""The scheduler half of the KV tiers' connector (connector.py): a waiting request's lookup in
the tiers while it heads the queue (kept until it is admitted), its asynchronous fetch from the
slow tiers, the loads of the blocks it was admitted with, and the saves of the blocks each step
completes - all through the TierManager, on the engine thread."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, wait
from typing import Any

from ..cache import BlockStored, KVCacheEvent, KVCacheManager
from .connector import StepPlan, TierRequest
from .lookup import TierFetch
from .manager import TierManager
from .plans import KVLoad, KVSave, SavedBlock
from .stats import TierStats


class TierSchedulerConnector:
    def __init__(self, manager: TierManager, block_size: int) -> None:
        self.manager = manager
        self.block_size = block_size
        # the queue head's lookup, kept while it waits for blocks: (request id, pool hits, KV bytes)
        self._lookup: tuple[str, int, list[memoryview]] | None = None
        # requests whose blocks are being read from a slow tier on a loader thread: they stay in
        # the waiting queue (WAITING_FOR_REMOTE_KVS, no blocks held) and are passed over until ready
        self._fetches: dict[str, TierFetch] = {}
        self._loads: list[KVLoad] = []  # of the requests admitted in the step being scheduled

    @property
    def num_loading(self) -> int:
        return len(self._fetches)

    def _eligible(self, req: TierRequest, kv: KVCacheManager) -> bool:
        # requests that skip the cache compute their prefix; so do those that read the stage outputs
        # of their hits, unless tier values carry them (the stage-output cache was on when saved)
        if not kv.enable_caching or req.skip_prefix_cache_read:
            return False
        return not req.reads_stage_outputs or self.manager.carries_stage_outputs

    def match(self, req: TierRequest, num_pool_hits: int, kv: KVCacheManager) -> int | None:
        """The blocks after the pool's hits that the tiers hold, looked up once while the request
        waits at the head of the queue. The in-memory tier is read here; when the chain goes on
        past it and a slow tier loads asynchronously, a fetch is started and None returned: the
        request waits and comes back here when it is ready."""
        memo = self._lookup
        if memo is not None and memo[0] == req.request_id and memo[1] == num_pool_hits:
            return len(memo[2])
        loaded: list[memoryview] = []
        tiers = self.manager
        fetch = self._fetches.pop(req.request_id, None)
        if self._eligible(req, kv):
            bs = self.block_size
            last = (req.num_tokens - 1) // bs  # the last token is always computed
            if num_pool_hits < last:
                hashes = kv.get_block_hashes(req)
                chain = kv.get_block_chain(req)
                describe = self._describer(req, kv)
                args = (hashes, req.all_token_ids, chain.extras, bs)
                loaded = tiers.lookup(*args, num_pool_hits, last, describe, sync_only=tiers.has_async_tiers)
                stop = num_pool_hits + len(loaded)
                if fetch is not None:  # back from its load (done, failed or timed out): take what it found
                    if stop < last:
                        loaded += tiers.take_fetched(fetch, stop, describe)
                    fetch = None
                elif stop < last and tiers.has_async_tiers:
                    fetch = tiers.start_fetch(*args, stop, last)
                    if fetch is not None:
                        self._fetches[req.request_id] = fetch
                        return None
        if fetch is not None:  # no longer needed (the pool holds the chain now)
            fetch.cancel()
        self._lookup = (req.request_id, num_pool_hits, loaded)
        return len(loaded)

    def load_ready(self, req_id: str) -> bool:
        return self._fetches[req_id].ready()

    def is_loading(self, req_id: str) -> bool:
        return req_id in self._fetches

    def _describer(self, req: TierRequest, kv: KVCacheManager) -> Callable[[int], BlockStored] | None:
        """block index -> its BlockStored event, for the tiers' KV events (None when those are off)."""
        if not self.manager.events_enabled:
            return None
        return lambda i: kv.describe_blocks(req, i, i + 1, "")

    def admitted(self, req: TierRequest, num_pool_hits: int, kv: KVCacheManager) -> None:
        """The first new blocks take the tiers' bytes; they count as cached tokens."""
        memo = self._lookup
        if memo is None:
            return
        self._lookup = None
        loaded = memo[2]
        if self._eligible(req, kv):
            self.manager.record_query(req.num_tokens, len(loaded) * self.block_size)
        if loaded:
            ids = kv.get_block_ids(req.request_id)[num_pool_hits : num_pool_hits + len(loaded)]
            self._loads.extend(self.manager.load_plan(ids, loaded))

    def plan(self, step: StepPlan, requests: Mapping[str, TierRequest], kv: KVCacheManager) -> None:
        """The loads of this step's admissions; and blocks this step's forward completes (never
        hits, never loaded ones) are copied out after it, write-through, unless every tier has
        them already. A block whose last token is still being sampled (a step scheduled ahead)
        has no hash yet: it is copied out all the same, and keyed when the step is booked
        (`saved`). A block that drafts complete (speculative decoding) is not copied out: which
        of its rows hold the request's tokens is known only when the step is booked."""
        if self._loads:
            step.kv_loads.extend(self._loads)
            self._loads.clear()
        if not kv.enable_caching:
            return
        bs = self.block_size
        for sr in step.scheduled:
            first, end = sr.start // bs, (sr.start + len(sr.token_ids) - len(sr.draft_token_ids)) // bs
            if first >= end:
                continue
            req = requests[sr.req_id]
            hashes = kv.get_block_hashes(req)
            extras = kv.get_block_chain(req).extras
            for i in range(first, end):
                if i >= len(hashes):
                    step.kv_saves.append(KVSave(sr.block_table[i], b"", b"", owner=(sr.req_id, i)))
                    continue
                save = self._save(req, sr.block_table[i], hashes[i], extras, i, kv)
                if save is not None:
                    step.kv_saves.append(save)

    def saved(self, blocks: Sequence[SavedBlock], requests: Mapping[str, TierRequest], kv: KVCacheManager) -> None:
        """Store the values of the step's saves; a block copied out before its last token was
        known is keyed now, from its request's tokens (those of a request that ended meanwhile
        are dropped: it stopped before that token, so in order no step would have completed the
        block)."""
        tiers = self.manager
        for block in blocks:
            owner = block.save.owner
            if owner is not None:
                req = requests.get(owner[0])
                if req is None:
                    continue
                index = owner[1]
                hashes = kv.get_block_hashes(req)
                if index >= len(hashes):
                    continue
                extras = kv.get_block_chain(req).extras
                save = self._save(req, block.save.block_id, hashes[index], extras, index, kv)
                if save is None:  # every tier has it already
                    continue
                block = tiers.seal(save, block.value)
            tiers.store(block)

    def _save(
        self,
        req: TierRequest,
        block_id: int,
        content_hash: bytes,
        extras: Sequence[Any] | None,
        index: int,
        kv: KVCacheManager,
    ) -> KVSave | None:
        """The save of the request's block `index` (TierManager.plan_save), with its KV event
        where those are on (each tier publishes it, its own medium, once stored)."""
        tiers = self.manager
        save = tiers.plan_save(block_id, content_hash, req.all_token_ids, extras, self.block_size, index)
        if save is not None and tiers.events_enabled:
            save.event = kv.describe_blocks(req, index, index + 1, "")
        return save

    def request_finished(self, req_id: str) -> None:
        if self._lookup is not None and self._lookup[0] == req_id:
            self._lookup = None
        fetch = self._fetches.pop(req_id, None)
        if fetch is not None:  # aborted while loading: it holds no block, the loader stops early
            fetch.cancel()

    def wait_for_loads(self, timeout_s: float) -> None:
        futures = [f.future for f in self._fetches.values() if f.future is not None]
        if futures:
            wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def take_events(self) -> Sequence[KVCacheEvent]:
        return self.manager.take_events()

    def stats(self) -> tuple[TierStats, ...]:
        return self.manager.stats()
