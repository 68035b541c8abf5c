"""Each mixture-of-experts family (Mixtral, Qwen2-MoE, Qwen3-MoE) as a tiny random checkpoint
through the whole engine: several prompts in one batch (their tokens routed to different experts),
greedy tokens equal to transformers' with caching off, with shared prefixes cached, with chunked
prefill and under preemption, and every KV block free afterwards."""

from __future__ import annotations

import pytest

from ..model.test_model_moe import KINDS, make_moe
from .engine_oracle import assert_disk_tier_and_stage_outputs, assert_engine_matches_transformers

MAX_NEW = 8


@pytest.mark.parametrize("kind", KINDS)
def test_moe_engine_matches_transformers(tmp_path, kind):
    assert_engine_matches_transformers(tmp_path, make_moe(kind), kind, MAX_NEW)


def test_moe_with_a_disk_tier_and_the_stage_output_cache(tmp_path):
    """K/V is per attention layer whatever the MLP: a new engine is served Qwen2-MoE's blocks from a
    disk tier (same tokens), and pooled embeddings from the stage-output cache equal transformers'
    final hidden states."""
    assert_disk_tier_and_stage_outputs(tmp_path, make_moe("qwen2_moe"), 8, MAX_NEW)
