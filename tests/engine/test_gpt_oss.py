"""gpt-oss as a tiny random checkpoint through the whole engine: greedy tokens equal to
transformers' with caching off, with shared prefixes cached (sliding and full layers in their
KV-cache groups), with chunked prefill and under preemption, every KV block free afterwards; a
disk tier and the stage-output cache serve it as any attention model."""

from __future__ import annotations

from ..model.test_model_gpt_oss import make_gpt_oss
from .engine_oracle import (
    assert_adapter_equals_peft,
    assert_disk_tier_and_stage_outputs,
    assert_engine_matches_transformers,
)

MAX_NEW = 8


def test_gpt_oss_engine_matches_transformers(tmp_path):
    # two KV-cache groups (sliding, full): 24 blocks hold a 96-token request, and preempt
    assert_engine_matches_transformers(tmp_path, make_gpt_oss(), "gpt-oss", MAX_NEW, preempting_blocks=24)


def test_gpt_oss_with_a_disk_tier_and_the_stage_output_cache(tmp_path):
    assert_disk_tier_and_stage_outputs(tmp_path, make_gpt_oss(seed=1), 8, MAX_NEW)


def test_lora_on_gpt_oss_attention(tmp_path):
    """An adapter on gpt-oss's attention projections (the output one has a bias) equals PEFT's
    greedy tokens; every block free after."""
    assert_adapter_equals_peft(tmp_path, make_gpt_oss(seed=2), ["q_proj", "v_proj", "o_proj"], seed=5)


def test_serving_gpt_oss_without_the_harmony_parser_says_how(tmp_path, caplog):
    """Without --reasoning-parser openai_gptoss a reply's content is the whole harmony text (as
    vLLM's): the server says so at start, naming the flags."""
    import logging

    from prefixkv.config import EngineConfig
    from prefixkv.engine.llm_engine import LLMEngine
    from prefixkv.model import load_model
    from prefixkv.server.app import create_app

    from ..model.test_model_hf_folder import _write_tokenizer

    make_gpt_oss().save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    loaded = load_model(str(tmp_path))
    engine = LLMEngine(EngineConfig(dtype="float32", device="cpu", num_blocks=32, max_model_len=64), loaded=loaded)
    with caplog.at_level(logging.WARNING, logger="prefixkv.server"):
        create_app(engine, engine_thread=False)
    assert "--reasoning-parser openai_gptoss" in caplog.text and "--tool-call-parser openai" in caplog.text
