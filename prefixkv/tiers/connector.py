"""The KV connector: how the engine talks to whatever keeps KV blocks below its pool, split as
vLLM v1 splits its KV connector into two halves that never call each other.

- The scheduler half (`SchedulerConnector`, on the engine thread) answers how many blocks after
  the pool's hits it can serve (starting an asynchronous fetch when a slow tier must be read),
  plans each step's loads and saves into the SchedulerOutput (plans.py), takes back the values the
  worker half made of the saves, and has KV events and counters.
- The worker half (`WorkerConnector`, in the model runner) executes the plans against the
  per-block tensors: loads before the forward, saves after it, returned in the ModelRunnerOutput.

The null connectors (null.py) are what an engine without tiers holds: nothing is planned, so the
worker half is never asked for anything. The tiers' connectors are scheduler_connector.py and
transfer.py, built together by build.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from ..cache import CacheRequest, KVCacheEvent, KVCacheManager
from .plans import KVLoad, KVSave, SavedBlock
from .stats import TierStats


class TierRequest(CacheRequest, Protocol):
    """What the scheduler half reads of a request, beyond what the cache reads."""

    @property
    def skip_prefix_cache_read(self) -> bool: ...

    @property
    def reads_stage_outputs(self) -> bool: ...


class ScheduledChunk(Protocol):
    """What the scheduler half reads of one request's share of a step."""

    @property
    def req_id(self) -> str: ...

    @property
    def start(self) -> int: ...

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def draft_token_ids(self) -> Sequence[int]: ...  # the last of token_ids that are drafts

    @property
    def block_table(self) -> Sequence[int]: ...


class StepPlan(Protocol):
    """The step being planned (the engine's SchedulerOutput): the chunks scheduled, and the plans."""

    @property
    def scheduled(self) -> Sequence[ScheduledChunk]: ...

    kv_loads: list[KVLoad]
    kv_saves: list[KVSave]


class SchedulerConnector(Protocol):
    @property
    def num_loading(self) -> int:
        """Requests whose blocks are being fetched asynchronously."""
        ...

    def match(self, req: TierRequest, num_pool_hits: int, kv: KVCacheManager) -> int | None:
        """How many blocks after the pool's `num_pool_hits` hits it can load for a waiting
        request; None when an asynchronous fetch has just started (the request waits for it,
        holding no block, and is asked again once `load_ready`)."""
        ...

    def load_ready(self, req_id: str) -> bool:
        """The request's asynchronous fetch is done (or given up): ask `match` again."""
        ...

    def is_loading(self, req_id: str) -> bool:
        """A fetch is still held for the request."""
        ...

    def admitted(self, req: TierRequest, num_pool_hits: int, kv: KVCacheManager) -> None:
        """The request got blocks for the pool's hits, the matched blocks and its new tokens:
        the matched blocks are loaded in this step."""
        ...

    def plan(self, step: StepPlan, requests: Mapping[str, TierRequest], kv: KVCacheManager) -> None:
        """Fill the step's loads and saves once every request is scheduled."""
        ...

    def saved(self, blocks: Sequence[SavedBlock], requests: Mapping[str, TierRequest], kv: KVCacheManager) -> None:
        """The values the worker half made of the step's saves (`requests` and `kv` key those
        copied out before their last token was known: KVSave.owner)."""
        ...

    def request_finished(self, req_id: str) -> None: ...

    def wait_for_loads(self, timeout_s: float) -> None:
        """Nothing else to run: sleep until a fetch completes, at most `timeout_s`."""
        ...

    def take_events(self) -> Sequence[KVCacheEvent]: ...

    def stats(self) -> tuple[TierStats, ...]: ...


class PendingSaves(Protocol):
    """A step's saves, copied out in the device's order: their values are read with the step's
    tokens, when it is booked."""

    def result(self) -> list[SavedBlock]:
        """The values, in the saves' order (waiting for the copies if they still run)."""
        ...


class PendingLoads(Protocol):
    """A step's loads, copied in the device's order, but for the rows the engine writes when a
    step is booked (the stage-output cache's)."""

    def finish(self) -> None:
        """Copy those rows in too (when the step is booked, or at once where no step before it
        is still unbooked)."""
        ...


class WorkerConnector(Protocol):
    def load(self, loads: Sequence[KVLoad]) -> PendingLoads:
        """Copy the loads' bytes into their blocks (before the forward that reads them, in the
        device's order: the host need not wait); the booked rows when `finish` is called."""
        ...

    def save(self, saves: Sequence[KVSave]) -> PendingSaves:
        """Copy the saves' blocks out (after the forward that wrote them), sealed when read."""
        ...
