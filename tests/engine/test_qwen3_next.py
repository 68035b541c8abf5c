"""Qwen3-Next (gated delta net layers with a recurrent state per block, gated full attention layers
with K/V rows, routed experts with a gated shared expert) through the model and the whole engine,
against transformers' Qwen3NextForCausalLM on a tiny random checkpoint: the chunked delta rule
against transformers' per-token recurrence, logits equal across chunks split mid-block, greedy
tokens equal with caching off and on (a prefix hit restoring the delta nets' state and the
attention layers' K/V together), under chunked prefill and preemption, every block free
afterwards."""

from __future__ import annotations

import pytest
import torch

from prefixkv.memory.block_tensors import BlockTensors, allocate_kv_cache, kv_cache_specs
from prefixkv.model import AttentionMetadata, ModelConfig, load_model
from prefixkv.model.gated_delta import GatedDeltaNet
from prefixkv.model.mamba2 import RecurrentState
from prefixkv.model.moe import SparseMoeBlock

from ..model.test_model_hf_folder import _write_tokenizer
from .engine_oracle import (
    KV_SHAPED_FEATURES,
    assert_prompt_logprobs_over_stage_outputs,
    assert_recurrent_engine_matches_transformers,
    assert_refused,
)

MAX_NEW = 8
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def make_qwen3_next(seed: int = 0, tie: bool = False, **overrides):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    settings = dict(
        vocab_size=258,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        layer_types=LAYER_TYPES,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        mlp_only_layers=[2],
        max_position_embeddings=256,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=257,
        tie_word_embeddings=tie,
        attn_implementation="eager",
    )
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**{**settings, **overrides})).eval()
    with torch.no_grad():  # an input-dependent state and attention that matter: larger weights than the init's
        for name, p in model.named_parameters():
            if "linear_attn.norm" in name:  # a plain norm weight
                p.normal_(1, 0.1)
            elif "norm" in name:  # zero-centred norms start at 0: make the folded 1 + w count
                p.normal_(0, 0.1)
        for layer in model.model.layers:
            if layer.block_type == "linear_attention":
                for proj in (layer.linear_attn.in_proj_qkvz, layer.linear_attn.in_proj_ba, layer.linear_attn.out_proj):
                    proj.weight.normal_(0, 0.2)
            else:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                    proj.weight.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_next")
    hf = make_qwen3_next()
    hf.save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder)
    return hf, str(folder)


def test_chunked_delta_rule_matches_transformers_recurrence():
    """The mixer alone, one prompt split over chunks that start mid-block, each token's output
    against transformers' token-by-token gated delta rule; the state stored in each block is the
    recurrence's after that block's last token."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    hf = make_qwen3_next()
    layer = hf.model.layers[0].linear_attn
    assert isinstance(layer, Qwen3NextGatedDeltaNet)
    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    mixer = GatedDeltaNet(config)
    mixer.load_state_dict(layer.state_dict())
    bs, n = 4, 19
    x = torch.randn(1, n, config.hidden_size, generator=torch.Generator().manual_seed(2))
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    ref, ref_states = [], []
    with torch.no_grad():
        for t in range(n):  # one token a call: transformers' recurrent form throughout
            ref.append(layer(x[:, t : t + 1], cache=cache))
            ref_states.append(cache.get_recurrent_state(0, state_idx=0)[0].clone())
    ref_out = torch.cat(ref, dim=1)[0]
    caches = allocate_kv_cache(config, 8, bs)
    state = caches[0]
    assert isinstance(state, RecurrentState)
    table = torch.tensor([[2, 7, 0, 5, 3]])
    got = []
    with torch.no_grad():
        for a, b in ((0, 6), (6, 7), (7, 18), (18, 19)):
            slots = torch.tensor([table[0, p // bs].item() * bs + p % bs for p in range(a, b)])
            meta = AttentionMetadata(slots, [0, b - a], [b], table)
            got.append(mixer(x[0, a:b], state, meta))
    torch.testing.assert_close(torch.cat(got), ref_out, atol=1e-5, rtol=1e-5)
    for block_index, block in enumerate(table[0].tolist()):
        last = min(n, (block_index + 1) * bs) - 1
        torch.testing.assert_close(state.ssm[block], ref_states[last], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "tie, overrides, sparse",
    [
        (False, {}, [True, True, False, True]),
        (True, {}, [True, True, False, True]),
        # dense MLPs; one value head per q/k head
        (False, dict(num_experts=0, linear_num_value_heads=2), [False] * 4),
        (False, dict(decoder_sparse_step=2, mlp_only_layers=[]), [False, True, False, True]),
    ],
)
def test_qwen3_next_model_matches_transformers(tmp_path, tie, overrides, sparse):
    """One prefill split into two chunks (the second starting mid-block), then a decode step;
    layers get K/V tensors and recurrent states by their kind; MLPs routed or dense as the config
    says."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    hf = make_qwen3_next(tie=tie, **overrides)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    loaded = load_model(str(tmp_path))
    assert (loaded.model.lm_head is None) == tie
    config, model, bs = loaded.config, loaded.model, 8
    assert config.rotary_dim == 4  # transformers' default partial_rotary_factor 0.25 of head_dim 16
    assert [isinstance(layer.mlp, Qwen3NextSparseMoeBlock) for layer in hf.model.layers] == sparse
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers] == sparse
    caches = allocate_kv_cache(config, 8, bs)
    kinds = [isinstance(c, RecurrentState) for c in caches]
    assert kinds == [t == "linear_attention" for t in LAYER_TYPES]
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


def test_qwen3_next_block_bytes_count_both_kinds(checkpoint):
    """One block id costs an attention layer's K/V rows plus a delta net layer's states."""
    _, folder = checkpoint
    config = ModelConfig.from_hf_folder(folder)
    specs = kv_cache_specs(config, 8, torch.float32)
    names = [s.name for s in specs]
    assert names == ["state.0.ssm", "state.0.conv", "kv.1", "state.2.ssm", "state.2.conv", "kv.3"]
    kv = 2 * 8 * config.num_key_value_heads * config.head_dim * 4
    conv_dim = 2 * 2 * 16 + 4 * 16
    state = (4 * 16 * 16 + conv_dim * 3) * 4
    assert BlockTensors(specs).bytes_per_block == 2 * kv + 2 * state


def test_qwen3_next_engine_matches_transformers(checkpoint):
    hf, folder = checkpoint
    assert_recurrent_engine_matches_transformers(folder, hf, MAX_NEW)


@pytest.mark.parametrize("kwargs, name", KV_SHAPED_FEATURES)
def test_qwen3_next_refuses_kv_shaped_features(checkpoint, kwargs, name):
    assert_refused(checkpoint[1], kwargs, name)


def test_qwen3_next_config_from_model_type_and_refusals():
    base = dict(
        model_type="qwen3_next",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        decoder_sparse_step=2,
    )
    cfg = ModelConfig.from_hf_dict(base)
    assert cfg.architecture == "Qwen3NextForCausalLM" and cfg.is_recurrent
    # transformers' default: full attention every 4th layer
    assert [cfg.is_recurrent_layer(i) for i in range(4)] == [True, True, True, False]
    assert [cfg.is_attention_layer(i) for i in range(4)] == [False, False, False, True]
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert cfg.rotary_dim == 4
    # the published checkpoints' older keys: rotary settings at the top level
    published = ModelConfig.from_hf_dict({**base, "rope_theta": 1e7, "partial_rotary_factor": 0.5})
    assert published.rope_theta == 1e7 and published.rotary_dim == 8
    dense = ModelConfig.from_hf_dict({**base, "num_experts": 0})
    assert not any(dense.is_moe_layer(i) for i in range(4)) and dense.shared_expert_intermediate_size == 0
    attention_only = ModelConfig.from_hf_dict({**base, "layer_types": ["full_attention"] * 4})
    assert not attention_only.is_recurrent
    for key, value in (("hidden_act", "gelu"), ("attention_bias", True)):
        with pytest.raises(ValueError, match=key):
            ModelConfig.from_hf_dict({**base, key: value})
    with pytest.raises(ValueError, match="sliding_attention"):
        ModelConfig.from_hf_dict({**base, "layer_types": ["sliding_attention"] * 4})
    with pytest.raises(ValueError, match="rope scaling"):
        ModelConfig.from_hf_dict({**base, "rope_parameters": {"rope_type": "linear", "factor": 2.0}})
    with pytest.raises(ValueError, match="multiple of linear_num_key_heads"):
        ModelConfig.from_hf_dict({**base, "linear_num_value_heads": 3})


def test_qwen3_next_skips_the_mtp_head(checkpoint, tmp_path):
    """A checkpoint's multi-token-prediction tensors (mtp.*), which transformers' CausalLM does not
    load, change nothing."""
    from safetensors.torch import load_file, save_file

    hf, folder = checkpoint
    import shutil
    from pathlib import Path

    for f in Path(folder).iterdir():
        shutil.copy(f, tmp_path / f.name)
    weights = load_file(str(tmp_path / "model.safetensors"))
    weights["mtp.fc.weight"] = torch.zeros(64, 128)
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    loaded = load_model(str(tmp_path))
    ids = torch.arange(5)
    caches = allocate_kv_cache(loaded.config, 4, 8)
    meta = AttentionMetadata(torch.arange(5), [0, 5], [5], torch.tensor([[0]]))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    got = loaded.model.compute_logits(loaded.model(ids, torch.arange(5), caches, meta))
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_qwen3_next_prompt_logprobs_with_stage_output_cache(checkpoint):
    """Prompt logprobs over a cached prefix (its hidden states from the stage-output cache) equal
    the uncached ones."""
    hf, folder = checkpoint
    assert_prompt_logprobs_over_stage_outputs(folder, hf)
