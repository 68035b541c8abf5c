"""Bamba (Mamba2 layers and attention layers in one model, each layer's K/V or recurrent state in
the same blocks) through the model and the whole engine, against transformers' BambaForCausalLM on
a tiny random checkpoint: logits equal across chunks split mid-block, greedy tokens equal with
caching off and on (a prefix hit restoring the Mamba layers' state and the attention layers' K/V
together), under chunked prefill and preemption, every block free afterwards."""

from __future__ import annotations

import pytest
import torch

from prefixkv.memory.block_tensors import BlockTensors, allocate_kv_cache, kv_cache_specs
from prefixkv.model import AttentionMetadata, ModelConfig, load_model
from prefixkv.model.mamba2 import RecurrentState

from ..model.test_model_hf_folder import _write_tokenizer
from .engine_oracle import (
    KV_SHAPED_FEATURES,
    assert_prompt_logprobs_over_stage_outputs,
    assert_recurrent_engine_matches_transformers,
    assert_refused,
)

MAX_NEW = 8
ATTN_LAYERS = [1, 3]


def make_bamba(seed: int = 0, tie: bool = False):
    from transformers import BambaConfig, BambaForCausalLM

    torch.manual_seed(seed)
    config = BambaConfig(
        vocab_size=258,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_indices=ATTN_LAYERS,
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_n_groups=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=16,
        max_position_embeddings=256,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=257,
        tie_word_embeddings=tie,
    )
    model = BambaForCausalLM(config).eval()
    with torch.no_grad():  # an input-dependent state and attention that matter: larger weights than the init's
        for layer in model.model.layers:
            mixer = getattr(layer, "mamba", None)
            if mixer is not None:
                mixer.in_proj.weight.normal_(0, 0.2)
                mixer.out_proj.weight.normal_(0, 0.2)
            else:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                    proj.weight.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bamba")
    hf = make_bamba()
    hf.save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder)
    return hf, str(folder)


@pytest.mark.parametrize("tie", [False, True])
def test_bamba_model_matches_transformers(tmp_path, tie):
    """One prefill split into two chunks (the second starting mid-block), then a decode step;
    layers get K/V tensors and recurrent states by their kind."""
    hf = make_bamba(tie=tie)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    loaded = load_model(str(tmp_path))
    assert (loaded.model.lm_head is None) == tie
    config, model, bs = loaded.config, loaded.model, 8
    assert config.rotary_dim == config.head_dim // 2
    caches = allocate_kv_cache(config, 8, bs)
    kinds = [isinstance(c, RecurrentState) for c in caches]
    assert kinds == [i not in ATTN_LAYERS for i in range(4)]
    ids = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    table = torch.tensor([[3, 5, 1, 6]])
    got = []
    for a, b in ((0, 11), (11, 20), (20, 21)):
        slots = torch.tensor([table[0, p // bs].item() * bs + p % bs for p in range(a, b)])
        meta = AttentionMetadata(slots, [0, b - a], [b], table)
        got.append(model.compute_logits(model(ids[a:b], torch.arange(a, b), caches, meta)))
    torch.testing.assert_close(torch.cat(got), ref, atol=1e-4, rtol=1e-4)


def test_bamba_block_bytes_count_both_kinds(checkpoint):
    """One block id costs an attention layer's K/V rows plus a Mamba layer's states."""
    _, folder = checkpoint
    config = ModelConfig.from_hf_folder(folder)
    specs = kv_cache_specs(config, 8, torch.float32)
    names = [s.name for s in specs]
    assert names == ["state.0.ssm", "state.0.conv", "kv.1", "state.2.ssm", "state.2.conv", "kv.3"]
    kv = 2 * 8 * config.num_key_value_heads * config.head_dim * 4
    conv_dim = config.ssm_intermediate_size + 2 * config.ssm_n_groups * config.ssm_state_size
    state = (config.ssm_num_heads * config.ssm_head_dim * config.ssm_state_size + conv_dim * 3) * 4
    assert BlockTensors(specs).bytes_per_block == 2 * kv + 2 * state


def test_bamba_engine_matches_transformers(checkpoint):
    hf, folder = checkpoint
    assert_recurrent_engine_matches_transformers(folder, hf, MAX_NEW)


@pytest.mark.parametrize("kwargs, name", KV_SHAPED_FEATURES)
def test_bamba_refuses_kv_shaped_features(checkpoint, kwargs, name):
    assert_refused(checkpoint[1], kwargs, name)


def test_bamba_config_from_model_type_and_refusals():
    base = dict(
        model_type="bamba",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        mamba_n_heads=4,
        mamba_n_groups=1,
        mamba_d_state=16,
        attn_layer_indices=[2],
    )
    cfg = ModelConfig.from_hf_dict(base)
    assert cfg.architecture == "BambaForCausalLM" and cfg.is_recurrent
    assert [cfg.is_recurrent_layer(i) for i in range(3)] == [True, True, False]
    assert cfg.ssm_head_dim == 32 and cfg.ssm_intermediate_size == 128 and cfg.intermediate_size == 96
    assert cfg.rotary_dim == 8  # transformers' default: half of head_dim 16
    full = ModelConfig.from_hf_dict({**base, "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 1.0}})
    assert full.rotary_dim == 16
    for key, value in (("hidden_act", "gelu"), ("attention_bias", True), ("mlp_bias", True)):
        with pytest.raises(ValueError, match=key):
            ModelConfig.from_hf_dict({**base, key: value})
    attention_only = ModelConfig.from_hf_dict({**base, "attn_layer_indices": [0, 1, 2]})
    assert not attention_only.is_recurrent and all(attention_only.is_attention_layer(i) for i in range(3))
    with pytest.raises(ValueError, match="attn_layer_indices"):
        ModelConfig.from_hf_dict({**base, "attn_layer_indices": [3]})
    with pytest.raises(ValueError, match="rope scaling"):
        ModelConfig.from_hf_dict({**base, "rope_parameters": {"rope_type": "linear", "factor": 2.0}})


def test_bamba_prompt_logprobs_with_stage_output_cache(checkpoint):
    """Prompt logprobs over a cached prefix (its hidden states from the stage-output cache) equal
    the uncached ones."""
    hf, folder = checkpoint
    assert_prompt_logprobs_over_stage_outputs(folder, hf)
