"""One engine on the embedded model for every constraints test; after each test nothing may be
left running and every KV block must be free again."""

from __future__ import annotations

import pytest

from prefixkv import LLM
from prefixkv.config import EngineConfig
from prefixkv.engine.llm_engine import LLMEngine


@pytest.fixture(scope="session")
def constrained_llm(default_lm):
    return LLM.from_engine(
        LLMEngine(
            EngineConfig(dtype="float32", device="cpu", num_blocks=96, block_size=16, max_model_len=1024),
            loaded=default_lm,
        )
    )


@pytest.fixture(autouse=True)
def nothing_left_behind(constrained_llm):
    yield
    engine = constrained_llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
