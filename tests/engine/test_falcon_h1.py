"""Falcon-H1 (a Mamba2 mixer and attention side by side in every layer, each layer keeping both
its K/V rows and its recurrent state in the same blocks; muP multipliers folded at load) through
the model and the whole engine, against transformers' FalconH1ForCausalLM on tiny random
checkpoints: logits equal across chunks split mid-block for each gate/norm variant and a tied
head, greedy tokens equal with caching off and on (a prefix hit), under chunked prefill and
preemption, every block free afterwards."""

from __future__ import annotations

import pytest
import torch

from prefixkv.memory.block_tensors import BlockTensors, allocate_kv_cache, kv_cache_specs
from prefixkv.model import AttentionMetadata, ModelConfig, load_model
from prefixkv.model.mamba2 import RecurrentState

from ..model.test_model_hf_folder import _write_tokenizer
from .engine_oracle import KV_SHAPED_FEATURES, assert_recurrent_engine_matches_transformers, assert_refused

MAX_NEW = 8
# (mamba_rms_norm, mamba_norm_before_gate) -> ModelConfig.ssm_norm
NORMS = {(False, True): "none", (True, True): "norm_then_gate", (True, False): "gate_then_norm"}


def make_falcon_h1(seed: int = 0, tie: bool = False, rms_norm: bool = False, norm_before_gate: bool = True):
    from transformers import FalconH1Config, FalconH1ForCausalLM

    torch.manual_seed(seed)
    config = FalconH1Config(
        vocab_size=258,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_d_ssm=96,  # not expand x hidden: the mixer's own width
        mamba_n_heads=4,
        mamba_n_groups=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_chunk_size=16,
        mamba_rms_norm=rms_norm,
        mamba_norm_before_gate=norm_before_gate,
        embedding_multiplier=2.0,
        lm_head_multiplier=0.5,
        mlp_multipliers=[0.7, 1.3],
        key_multiplier=1.5,
        attention_in_multiplier=0.8,
        attention_out_multiplier=1.2,
        ssm_multipliers=[0.5, 1.5, 0.9, 1.1, 1.2],
        ssm_in_multiplier=1.3,
        ssm_out_multiplier=0.6,
        max_position_embeddings=256,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=257,
        tie_word_embeddings=tie,
    )
    model = FalconH1ForCausalLM(config).eval()
    with torch.no_grad():  # an input-dependent state and attention that matter: larger weights than the init's
        for layer in model.model.layers:
            layer.mamba.in_proj.weight.normal_(0, 0.2)
            layer.mamba.out_proj.weight.normal_(0, 0.2)
            layer.self_attn.q_proj.weight.normal_(0, 0.3)
            layer.self_attn.k_proj.weight.normal_(0, 0.3)
            if rms_norm:
                layer.mamba.norm.weight.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("falcon_h1")
    hf = make_falcon_h1()
    hf.save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder)
    return hf, str(folder)


@pytest.mark.parametrize(
    "tie, rms_norm, before",
    [(False, False, True), (True, False, True), (False, True, True), (False, True, False)],
)
def test_falcon_h1_model_matches_transformers(tmp_path, tie, rms_norm, before):
    """One prefill split into two chunks (the second starting mid-block), then a decode step; every
    layer gets its K/V tensor and its recurrent state."""
    hf = make_falcon_h1(tie=tie, rms_norm=rms_norm, norm_before_gate=before)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    loaded = load_model(str(tmp_path))
    config, model, bs = loaded.config, loaded.model, 8
    assert config.ssm_norm == NORMS[(rms_norm, before)]
    assert (model.lm_head is None) == tie
    caches = allocate_kv_cache(config, 8, bs)
    assert all(isinstance(kv, torch.Tensor) and isinstance(state, RecurrentState) for kv, state in caches)
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


def test_falcon_h1_block_bytes_count_both_per_layer(checkpoint):
    _, folder = checkpoint
    config = ModelConfig.from_hf_folder(folder)
    specs = kv_cache_specs(config, 8, torch.float32)
    assert [s.name for s in specs] == ["kv.0", "state.0.ssm", "state.0.conv", "kv.1", "state.1.ssm", "state.1.conv"]
    kv = 2 * 8 * config.num_key_value_heads * config.head_dim * 4
    conv_dim = config.ssm_intermediate_size + 2 * config.ssm_n_groups * config.ssm_state_size
    state = (config.ssm_num_heads * config.ssm_head_dim * config.ssm_state_size + conv_dim * 3) * 4
    assert BlockTensors(specs).bytes_per_block == 2 * (kv + state)


def test_falcon_h1_engine_matches_transformers(checkpoint):
    hf, folder = checkpoint
    assert_recurrent_engine_matches_transformers(folder, hf, MAX_NEW)


@pytest.mark.parametrize("kwargs, name", KV_SHAPED_FEATURES)
def test_falcon_h1_refuses_kv_shaped_features(checkpoint, kwargs, name):
    assert_refused(checkpoint[1], kwargs, name)


def test_falcon_h1_config_from_model_type_and_refusals():
    base = dict(
        model_type="falcon_h1",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        mamba_d_ssm=None,
        mamba_n_heads=4,
        mamba_d_state=16,
    )
    cfg = ModelConfig.from_hf_dict(base)
    assert cfg.architecture == "FalconH1ForCausalLM" and cfg.is_recurrent
    assert all(cfg.is_recurrent_layer(i) and cfg.is_attention_layer(i) for i in range(2))
    assert cfg.ssm_intermediate_size == 128 and cfg.ssm_head_dim == 32 and cfg.ssm_norm == "none"
    assert cfg.rotary_dim == cfg.head_dim == 16
    for key in ("attention_bias", "mlp_bias", "projectors_bias", "mamba_proj_bias"):
        with pytest.raises(ValueError, match=key):
            ModelConfig.from_hf_dict({**base, key: True})
    with pytest.raises(ValueError, match="ssm_multipliers"):
        ModelConfig.from_hf_dict({**base, "ssm_multipliers": [1.0, 1.0]})
    with pytest.raises(ValueError, match="embedding_multiplier"):
        ModelConfig.from_hf_dict({**base, "embedding_multiplier": 0.0})
