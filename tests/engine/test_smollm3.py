"""SmolLM3 (layers without rotary, NoPE, every few layers; tied embeddings) as a tiny random
checkpoint through the whole engine: greedy tokens equal to transformers' with caching off, on,
chunked and preempted, every KV block free afterwards."""

from __future__ import annotations

from ..model.test_model_hf_folder import _make
from .engine_oracle import assert_engine_matches_transformers


def test_smollm3_engine_matches_transformers(tmp_path):
    assert_engine_matches_transformers(tmp_path, _make("smollm3"), "smollm3", 8)
