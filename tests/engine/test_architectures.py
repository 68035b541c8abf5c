"""Each supported architecture, as a tiny random checkpoint written in the test, served through
the whole engine: greedy outputs equal transformers' with caching off, with shared prefixes
cached, with chunked prefill, and under preemption."""

from __future__ import annotations

import pytest

from ..model.test_model_hf_folder import _make
from .engine_oracle import assert_engine_matches_transformers

MAX_NEW = 10


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
def test_engine_matches_transformers(tmp_path, kind):
    assert_engine_matches_transformers(tmp_path, _make(kind), kind, MAX_NEW)
