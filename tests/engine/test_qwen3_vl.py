"""Qwen3-VL's checkpoints (transformers' Qwen3VLForConditionalGeneration) served text-only: the
language model is Qwen3's decoder, whose interleaved multimodal rotary over text is the plain one;
the vision encoder is not loaded. Against transformers on a tiny random checkpoint: logits over
chunks and decodes, greedy tokens through the engine with caching off and on, chunked and
preempted, every block free; likewise the MoE variant (Qwen3-MoE's decoder), whose checkpoints
keep the experts transposed ([E, H, 2I], [E, I, H])."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from prefixkv.model import ModelConfig

from ..model.test_model_hf_folder import _write_tokenizer
from .engine_oracle import assert_engine_matches_transformers
from .test_mistral3 import _logits

TEXT = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=256, eos_token_id=257,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                     "mrope_interleaved": True},
)  # fmt: skip


def make_qwen3_vl(tie: bool = False, moe: bool = False):
    """moe: 8 experts top 2 of width 24 (2I = 48, not the hidden 64: the transposed layouts differ)
    after a dense first layer."""
    import transformers as tf

    torch.manual_seed(0)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=8,
                  spatial_merge_size=2, deepstack_visual_indexes=[0])  # fmt: skip
    if moe:
        text = dict(TEXT, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[0])
        config = tf.Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie)
        model = tf.Qwen3VLMoeForConditionalGeneration(config).eval()
    else:
        config = tf.Qwen3VLConfig(text_config=TEXT, vision_config=vision, tie_word_embeddings=tie)
        model = tf.Qwen3VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" not in name:
                p.copy_((1.0 if "norm" in name else 0.0) + (0.1 if "norm" in name else 0.08) * torch.randn_like(p))
    return model


@pytest.mark.parametrize("tie, moe", [(False, False), (True, False), (False, True)])
def test_logits_match_transformers(tmp_path, tie, moe):
    hf = make_qwen3_vl(tie, moe)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    config = ModelConfig.from_hf_folder(str(tmp_path))
    assert config.qk_norm and config.head_dim == 16 and config.rope_scaling is None
    assert config.tie_word_embeddings == tie
    if moe:  # the experts as the released checkpoints hold them: [E, H, 2I] and [E, I, H]
        assert config.num_experts == 8 and config.norm_topk_prob and config.mlp_only_layers == (0,)
        path = tmp_path / "model.safetensors"
        saved = load_file(path)
        for name in [n for n in saved if ".mlp.experts." in n]:
            saved[name] = saved[name].transpose(1, 2).contiguous()
        assert saved["model.language_model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 64, 48)
        save_file(saved, path, metadata={"format": "pt"})
    ids = torch.randint(0, 250, (45,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_logits(str(tmp_path), ids), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("moe", [False, True])
def test_engine_matches_transformers(tmp_path, moe):
    """(transformers' save_pretrained writes the experts in its own layout, [E, 2I, H]: read as well)"""
    assert_engine_matches_transformers(tmp_path, make_qwen3_vl(moe=moe), "qwen3_vl", 8)
