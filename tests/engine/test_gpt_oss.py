"""gpt-oss as a tiny random checkpoint through the whole engine: greedy tokens equal to
transformers' with caching off, with shared prefixes cached (sliding and full layers in their
KV-cache groups), with chunked prefill and under preemption, every KV block free afterwards; a
disk tier and the stage-output cache serve it as any attention model."""

from __future__ import annotations

from ..model.test_model_gpt_oss import make_gpt_oss
from .engine_oracle import assert_disk_tier_and_stage_outputs, assert_engine_matches_transformers

MAX_NEW = 8


def test_gpt_oss_engine_matches_transformers(tmp_path):
    # two KV-cache groups (sliding, full): 24 blocks hold a 96-token request, and preempt
    assert_engine_matches_transformers(tmp_path, make_gpt_oss(), "gpt-oss", MAX_NEW, preempting_blocks=24)


def test_gpt_oss_with_a_disk_tier_and_the_stage_output_cache(tmp_path):
    assert_disk_tier_and_stage_outputs(tmp_path, make_gpt_oss(seed=1), 8, MAX_NEW)
