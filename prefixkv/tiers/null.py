"""The connectors of an engine without KV tiers: nothing matches, nothing is planned, nothing is
allocated per step; the scheduler and the runner hold these instead of testing for None."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..cache import KVCacheEvent, KVCacheManager
from .connector import PendingLoads, PendingSaves, StepPlan, TierRequest
from .plans import KVLoad, KVSave, SavedBlock
from .stats import TierStats

_NO_EVENTS: tuple[KVCacheEvent, ...] = ()


class NullSchedulerConnector:
    num_loading = 0

    def match(self, req: TierRequest, num_pool_hits: int, kv: KVCacheManager) -> int | None:
        return 0

    def load_ready(self, req_id: str) -> bool:
        return True

    def is_loading(self, req_id: str) -> bool:
        return False

    def admitted(self, req: TierRequest, num_pool_hits: int, kv: KVCacheManager) -> None:
        pass

    def plan(self, step: StepPlan, requests: Mapping[str, TierRequest], kv: KVCacheManager) -> None:
        pass

    def saved(self, blocks: Sequence[SavedBlock], requests: Mapping[str, TierRequest], kv: KVCacheManager) -> None:
        pass

    def request_finished(self, req_id: str) -> None:
        pass

    def wait_for_loads(self, timeout_s: float) -> None:
        pass

    def take_events(self) -> Sequence[KVCacheEvent]:
        return _NO_EVENTS

    def stats(self) -> tuple[TierStats, ...]:
        return ()


class NullWorkerConnector:
    def load(self, loads: Sequence[KVLoad]) -> PendingLoads:
        raise RuntimeError("KV tier transfers scheduled but the runner has no tiers")

    def save(self, saves: Sequence[KVSave]) -> PendingSaves:
        raise RuntimeError("KV tier transfers scheduled but the runner has no tiers")


NULL_SCHEDULER_CONNECTOR = NullSchedulerConnector()
NULL_WORKER_CONNECTOR = NullWorkerConnector()
