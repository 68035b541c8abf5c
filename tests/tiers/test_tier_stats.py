"""The tiers' counters in `get_stats()` are read when asked, not copied at the last step: a slow
store's background writer finishes saves after the step that queued them, and whoever flushed
the tiers (a test, a restart) or scrapes /metrics of an idle server must see every one of them."""

from __future__ import annotations

import os
import threading

from prefixkv.tiers.disk import DiskStore

from .conftest import all_free, engine, run, tier
from .test_engine_tiers import prompts


def test_saves_written_after_the_last_step_are_counted(tiny_model, tiny_loaded, tmp_path, monkeypatch):
    gate = threading.Event()
    real_put = DiskStore.put

    def slow_put(self, key, value):  # a disk slower than the engine: nothing lands until the gate opens
        gate.wait(10)
        real_put(self, key, value)

    monkeypatch.setattr(DiskStore, "put", slow_put)
    folder = tmp_path / "kv"
    eng = engine(tiny_model, tiny_loaded, kv_tier=f"disk:{folder}")
    try:
        run(eng, prompts(4, 1)[0])  # every step is done; its 11 blocks are queued, none written
        assert tier(eng, "disk").saves == 0
    finally:
        gate.set()
    eng.tiers.flush()
    disk = tier(eng, "disk")  # no step since the last one: the counters come from the tier itself
    assert (disk.saves, disk.saves_dropped, disk.errors) == (11, 0, 0)
    assert len([n for n in os.listdir(folder) if n.endswith(".kv")]) == 11
    assert all_free(eng)
