"""LFM2 (gated short convolutions with a conv state per block, GQA attention layers with q/k norms)
through the model and the whole engine, against transformers' Lfm2ForCausalLM on a tiny random
checkpoint: logits over chunks split mid-block and decodes equal, greedy tokens equal with caching
off and on (a prefix hit restoring the convolutions' state and attention's K/V together), under
chunked prefill and preemption, every block free afterwards; the MLP's adjusted width read as
transformers reads it."""

from __future__ import annotations

import pytest
import torch

from prefixkv.model import ModelConfig, load_model
from prefixkv.model.configs.lfm2 import mlp_width

from ..model.test_model_hf_folder import _write_tokenizer
from .engine_oracle import assert_recurrent_engine_matches_transformers
from .test_qwen3_5 import _chunked_logits

MAX_NEW = 8


def make_lfm2(seed: int = 0, **overrides):
    from transformers import Lfm2Config, Lfm2ForCausalLM

    torch.manual_seed(seed)
    settings = dict(
        vocab_size=258,
        hidden_size=64,
        intermediate_size=144,  # adjusted: 2/3 of it, rounded up to 32 -> 96
        block_multiple_of=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
        max_position_embeddings=256,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=257,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    model = Lfm2ForCausalLM(Lfm2Config(**{**settings, **overrides})).eval()
    with torch.no_grad():  # a convolution and attention that matter: larger weights than the init's
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1, 0.1)
            elif "conv" in name or "q_proj" in name or "k_proj" in name:
                p.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lfm2")
    hf = make_lfm2()
    hf.save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder)
    return hf, str(folder)


def test_config_read_as_transformers_reads_it(checkpoint):
    hf, folder = checkpoint
    config = ModelConfig.from_hf_folder(folder)
    assert config.layer_types == ["conv", "full_attention", "conv", "full_attention"]
    assert config.intermediate_size == hf.model.layers[0].feed_forward.w1.out_features == 96
    assert config.short_conv_kernel == 3 and config.tie_word_embeddings and config.qk_norm
    from transformers import Lfm2Config
    from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

    for settings in (
        dict(intermediate_size=12288, block_ffn_dim_multiplier=1.0),
        dict(intermediate_size=100, block_multiple_of=32),  # 66, rounded up
        dict(intermediate_size=100, block_multiple_of=32, block_ffn_dim_multiplier=1.5),
        dict(intermediate_size=100, block_auto_adjust_ff_dim=False),
    ):
        want = Lfm2MLP(Lfm2Config(hidden_size=8, **settings)).w1.out_features
        assert mlp_width(Lfm2Config(hidden_size=8, **settings).to_dict()) == want, settings


def test_logits_match_transformers(checkpoint):
    """One prefill in two chunks (the second starting mid-block), then a decode step."""
    hf, folder = checkpoint
    ids = torch.randint(0, 250, (21,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(_chunked_logits(folder, ids), ref, atol=1e-4, rtol=1e-4)


def test_engine_matches_transformers(checkpoint):
    hf, folder = checkpoint
    assert_recurrent_engine_matches_transformers(folder, hf, MAX_NEW)


def test_conv_state_is_all_a_conv_layer_keeps(checkpoint):
    """A short convolution's state per block is its last kernel - 1 inputs, no SSM part."""
    from prefixkv.memory.block_tensors import kv_cache_specs

    _, folder = checkpoint
    specs = {s.name: s.shape_per_block for s in kv_cache_specs(load_model(folder).config, 8, torch.float32)}
    assert specs["state.0.conv"] == (64, 2) and "state.0.ssm" not in specs and "kv.1" in specs


def test_gguf_matches_transformers(tmp_path, checkpoint):
    """A GGUF file by llama.cpp's converter rules (K/V heads per layer, 0 on a convolution; the
    conv kernel squeezed; the final norm named token_embd_norm): logits and the engine's tokens."""
    from ..model.gguf_convert import write_gguf

    hf, _ = checkpoint
    path = str(tmp_path / "lfm2.gguf")
    write_gguf(tmp_path / "lfm2.gguf", hf)
    config = load_model(path).config
    assert config.layer_types == hf.config.layer_types and config.intermediate_size == 96
    assert config.short_conv_kernel == 3 and config.tie_word_embeddings
    ids = torch.randint(0, 250, (21,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(_chunked_logits(path, ids), ref, atol=1e-4, rtol=1e-4)
    assert_recurrent_engine_matches_transformers(path, hf, MAX_NEW)


def make_lfm2_moe(seed: int = 0):
    """LFM2-MoE: a dense first layer, then 8 experts top 2 with a sigmoid router whose selection
    bias (randomised, so that it changes which experts are chosen) and scaling matter."""
    from transformers import Lfm2MoeConfig, Lfm2MoeForCausalLM

    torch.manual_seed(seed)
    config = Lfm2MoeConfig(
        vocab_size=258,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_dense_layers=1,
        num_experts=8,
        num_experts_per_tok=2,
        routed_scaling_factor=1.5,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
        max_position_embeddings=256,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=257,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    model = Lfm2MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1, 0.1)
            elif "conv" in name or "q_proj" in name or "k_proj" in name or ".gate." in name:
                p.normal_(0, 0.3)
            else:
                p.normal_(0, 0.1)
        for layer in model.model.layers[1:]:
            layer.feed_forward.expert_bias.normal_(0, 0.3)
    return model


def test_moe_logits_and_engine_match_transformers(tmp_path):
    from prefixkv.model.moe import SparseMoeBlock

    hf = make_lfm2_moe()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    config = ModelConfig.from_hf_folder(str(tmp_path))
    assert config.router_scoring == "sigmoid" and config.router_selection_bias and config.mlp_only_layers == (0,)
    model = load_model(str(tmp_path)).model
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers] == [False, True, True, True]
    assert model.layers[1].mlp.expert_bias.dtype == torch.float32
    ids = torch.randint(0, 250, (21,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(_chunked_logits(str(tmp_path), ids), ref, atol=1e-4, rtol=1e-4)
    assert_recurrent_engine_matches_transformers(str(tmp_path), hf, MAX_NEW)


def test_recurrent_conv_kernel_is_the_layers_own():
    """The fixed buffers' conv windows are sized by the model's recurrent conv kernel (LFM2: 3,
    Mamba2 and the delta net: 4 by default); mixed lengths are refused."""
    base = dict(architecture="Lfm2ForCausalLM", vocab_size=8, hidden_size=8, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, intermediate_size=8)  # fmt: skip
    assert ModelConfig(**base, layer_types=["conv", "full_attention"], short_conv_kernel=3).recurrent_conv_kernel == 3
    assert ModelConfig(**base).recurrent_conv_kernel == 0
    mixed = ModelConfig(**{**base, "architecture": "BambaForCausalLM"}, layer_types=["mamba", "conv"],
                        ssm_state_size=4, short_conv_kernel=3)  # fmt: skip
    with pytest.raises(ValueError, match="conv kernels of \\[3, 4\\]"):
        assert mixed.recurrent_conv_kernel
