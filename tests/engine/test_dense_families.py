"""The Llama decoder's other dense families as tiny random checkpoints through the whole engine:
SmolLM3 (layers without rotary every few layers, tied embeddings), Granite 3 (its four
multipliers), OLMo 2 (post-norm blocks, q/k normed over whole projections), OLMo 3 (its
sliding and full layers, the sliding ones on their own rotary) and Phi-3 (fused
checkpoint projections, partial rotary, LongRoPE). Greedy tokens equal to transformers' with
caching off, on, chunked and preempted, every KV block free afterwards; a LoRA adapter on
Granite's projections equal to PEFT's (the residual multiplier scales the adapter's delta too: it
is not folded into the weights); LongRoPE's context held to its original length."""

from __future__ import annotations

import pytest

from ..model.test_model_hf_folder import _make, _write_tokenizer
from .engine_oracle import assert_adapter_equals_peft, assert_engine_matches_transformers


@pytest.mark.parametrize("kind", ["smollm3", "granite", "olmo2", "olmo3", "phi3"])
def test_engine_matches_transformers(tmp_path, kind):
    # OLMo 3's sliding and full layers are two KV-cache groups: more blocks hold a request
    assert_engine_matches_transformers(tmp_path, _make(kind), kind, 8, preempting_blocks=24 if kind == "olmo3" else 12)


def test_lora_on_granite_equals_peft(tmp_path):
    assert_adapter_equals_peft(tmp_path, _make("granite"), ["q_proj", "o_proj", "down_proj"], seed=3)


def test_longrope_holds_the_context_to_its_original_length(tmp_path, caplog):
    """Phi-3's LongRoPE: its short factors are built, so max_model_len defaults to the original
    context (logged) and a longer one is refused by name."""
    import logging

    from prefixkv import LLM

    _make("phi3").save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    with caplog.at_level(logging.INFO):
        llm = LLM(str(tmp_path), dtype="float32", device="cpu", num_blocks=64, block_size=8)
    assert llm.llm_engine.max_model_len == 96 and "LongRoPE original context" in caplog.text
    with pytest.raises(ValueError, match="LongRoPE original context .96 tokens"):
        LLM(str(tmp_path), dtype="float32", device="cpu", num_blocks=64, block_size=8, max_model_len=97)
