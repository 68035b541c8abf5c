"""A built engine's long-lived objects are frozen out of Python's full collections
(engine/gc_heap.py), and an engine dropped before the next build is still freed."""

from __future__ import annotations

import gc
import weakref

import pytest

from prefixkv.config import EngineConfig
from prefixkv.engine import gc_heap
from prefixkv.engine.llm_engine import LLMEngine
from prefixkv.sampling_params import SamplingParams


def _engine(default_lm) -> LLMEngine:
    return LLMEngine(EngineConfig(dtype="float32", device="cpu", num_blocks=512, max_model_len=256), loaded=default_lm)


@pytest.fixture
def thresholds():
    """The collector's thresholds as they were before the test (a build raises the youngest)."""
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # Python's defaults
    yield
    gc.set_threshold(*before)


def test_a_built_engine_is_frozen_and_a_dropped_one_is_freed_by_the_next_build(default_lm, monkeypatch, thresholds):
    monkeypatch.setenv("PREFIXKV_FREEZE_GC", "1")  # the default; the suite turns it off (conftest)
    first = _engine(default_lm)
    assert gc.get_threshold() == (gc_heap.YOUNG_THRESHOLD, 10, 10)
    blocks = first.kv_cache_manager.block_pool.blocks
    assert gc.get_freeze_count() > len(blocks)
    # the cache's blocks, the engine's largest share of objects, are out of the collector's walks
    assert not any(b is blocks[0] for b in gc.get_objects(generation=2))
    first.add_request("The quick brown fox", SamplingParams(temperature=0, max_tokens=4))
    while first.has_unfinished_requests():
        first.step()
    alive = weakref.ref(first)
    del first, blocks
    gc.collect()
    assert alive() is not None  # frozen: kept until the heap is thawed
    second = _engine(default_lm)
    assert alive() is None  # the next build collected it
    assert gc.get_freeze_count() > len(second.kv_cache_manager.block_pool.blocks)


def test_the_switch_is_0_or_1(default_lm, monkeypatch, thresholds):
    monkeypatch.setenv("PREFIXKV_FREEZE_GC", "0")
    gc.unfreeze()
    _engine(default_lm)
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == (700, 10, 10)  # off: the collector as Python sets it
    monkeypatch.setenv("PREFIXKV_FREEZE_GC", "yes")
    with pytest.raises(ValueError, match="PREFIXKV_FREEZE_GC='yes'"):
        _engine(default_lm)
