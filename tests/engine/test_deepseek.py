"""DeepSeek-V3 (transformers' DeepseekV3ForCausalLM: Kimi K2's architecture too) and GLM-4.7-Flash
(Glm4MoeLiteForCausalLM) through the model and the whole engine, against transformers on tiny
random checkpoints: multi-head latent attention with its expansion folded into the query and
the output (one cached head of the latent and the rotary key), with and without the query's
rank, the interleaved rotary and not, YaRN with DeepSeek's softmax-scale correction; the
group-limited sigmoid router with a random selection bias, a shared expert, dense first layers.
Logits over chunks split mid-block and a decode equal; greedy tokens equal with caching off and
on, under chunked prefill and preemption, every block free afterwards."""

from __future__ import annotations

import pytest
import torch

from prefixkv.memory.block_tensors import kv_cache_specs
from prefixkv.model import ModelConfig, load_model
from prefixkv.model.moe import SparseMoeBlock

from .engine_oracle import assert_engine_matches_transformers
from .test_glm4_moe import _randomise, _save_with_prediction_layer
from .test_qwen3_5 import assert_chunked_logits_match

MAX_NEW = 8
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}  # fmt: skip


def make_deepseek(kind: str = "v3", seed: int = 0, wide_latent: bool = False):
    """kind: "v3" (a query rank, the interleaved rotary, YaRN), "plain" (no query rank, the
    rotary in halves, no scaling) or "glm_lite" (GLM-4.7-Flash: per-layer MLP kinds);
    `wide_latent`: the released latent and rotary key (512 + 64: a cached head of 576, what a GPU's
    attention kernels must take), the rest as tiny."""
    import transformers as tf

    torch.manual_seed(seed)
    sizes = dict(
        vocab_size=258, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3,
        n_shared_experts=1, routed_scaling_factor=2.5, max_position_embeddings=256, bos_token_id=256, eos_token_id=257,
        pad_token_id=257, attn_implementation="eager",
    )  # fmt: skip
    if wide_latent:
        sizes.update(kv_lora_rank=512, qk_rope_head_dim=64)
    if kind == "glm_lite":
        sizes.update(mlp_layer_types=["dense", "sparse", "sparse"], n_group=1, topk_group=1, v_head_dim=16)
        model = tf.Glm4MoeLiteForCausalLM(tf.Glm4MoeLiteConfig(**sizes))
    elif kind == "v3":
        model = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(**sizes, first_k_dense_replace=1, rope_parameters=YARN))
    else:
        sizes.update(q_lora_rank=None, rope_interleave=False)
        model = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(**sizes, first_k_dense_replace=1))
    model.eval()
    _randomise(model, "e_score_correction_bias")
    with torch.no_grad():  # latents that matter: the kv_b products at the init's scale fade
        for name, p in model.named_parameters():
            if "kv_b_proj" in name or "kv_a_proj" in name:
                p.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("kind", ["v3", "plain", "glm_lite"])
def test_logits_match_transformers(tmp_path, kind):
    """One prefill in two chunks (the second starting mid-block), then a decode step."""
    hf = make_deepseek(kind)
    folder = _save_with_prediction_layer(hf, tmp_path)
    config = ModelConfig.from_hf_folder(folder)
    assert config.is_mla and config.head_dim == 40 and config.num_key_value_heads == 1
    assert config.rope_interleaved == (kind != "plain") and config.mla_q_lora_rank == (0 if kind == "plain" else 24)
    assert config.mlp_only_layers == (0,) and config.shared_expert_intermediate_size == 32
    specs = {s.name: s.shape_per_block for s in kv_cache_specs(config, 8, torch.float32)}
    assert specs["kv.0"] == (1, 8, 1, 40)  # one latent head a token (32 + 8), once: key and value
    model = load_model(folder).model
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers] == [False, True, True]
    if kind == "v3":
        assert model.layers[0].self_attn.scale > (16 + 8) ** -0.5  # YaRN's correction, squared
    assert_chunked_logits_match(folder, hf)


@pytest.mark.parametrize("kind", ["v3", "glm_lite"])
def test_engine_matches_transformers(tmp_path, kind):
    assert_engine_matches_transformers(tmp_path, make_deepseek(kind), kind, MAX_NEW)


@pytest.mark.parametrize(
    "setting, name",
    [(dict(scoring_func="softmax"), "scoring_func"), (dict(topk_method="greedy"), "topk_method"),
     (dict(moe_layer_freq=2), "moe_layer_freq"), (dict(hidden_act="gelu"), "hidden_act")],
)  # fmt: skip
def test_routing_not_built_is_refused(setting, name):
    d = make_deepseek("plain").config.to_dict()
    d.update(architectures=["DeepseekV3ForCausalLM"], **setting)
    with pytest.raises(ValueError, match=name):
        ModelConfig.from_hf_dict(d)


def test_lora_is_refused_by_name(tmp_path):
    """LoRA adapts q/k/v and o projections: latent attention has none, so an adapter has nothing
    it could be applied to as trained."""
    from prefixkv import LLM

    folder = _save_with_prediction_layer(make_deepseek("plain"), tmp_path)
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(folder, enable_lora=True, num_blocks=16, block_size=8, max_model_len=64, dtype="float32")


def test_disk_tier_and_stage_outputs(tmp_path):
    """The latent rows move through a disk tier as any K/V block does (a new engine served them:
    same tokens), and pooled hidden states over a hit equal transformers'."""
    from .engine_oracle import assert_disk_tier_and_stage_outputs

    assert_disk_tier_and_stage_outputs(tmp_path, make_deepseek("v3"), 8, MAX_NEW)


@pytest.mark.parametrize("kind, split_kv_b", [("v3", True), ("v3", False), ("plain", True), ("glm_lite", True)])
def test_gguf_matches_transformers(tmp_path, kind, split_kv_b):
    """A GGUF file by llama.cpp's converter rules ("deepseek2": one K/V head of the latent and the
    rotary key, the per-head sizes in key_length_mla / value_length_mla, kv_b_proj split into
    each head's W_UK transposed and W_UV, or whole in an older file; YaRN's correction as its log
    multiplier; a prediction layer counted in block_count): the config read as from config.json,
    then logits and the engine's greedy tokens against transformers. llama.cpp rotates deepseek2
    in pairs: the file of a checkpoint whose rotary is in halves ("plain") is served in pairs, as
    llama.cpp serves it, so its logits are not that checkpoint's."""
    from ..model.gguf_convert import write_deepseek_gguf
    from .engine_oracle import assert_recurrent_engine_matches_transformers

    hf = make_deepseek(kind)
    folder = tmp_path / "hf"
    _save_with_prediction_layer(hf, folder)
    path = tmp_path / f"{kind}.gguf"
    write_deepseek_gguf(path, hf, split_kv_b=split_kv_b, mtp_blocks=1)
    from_json, from_gguf = ModelConfig.from_hf_folder(str(folder)), load_model(str(path)).config
    fields = ("num_hidden_layers", "head_dim", "num_key_value_heads", "mla_kv_lora_rank", "mla_q_lora_rank",
              "mla_qk_nope_head_dim", "mla_qk_rope_head_dim", "mla_v_head_dim", "num_experts", "mlp_only_layers",
              "router_scoring", "router_selection_bias", "routed_scaling_factor", "shared_expert_intermediate_size",
              "shared_expert_gated", "router_logits_float32", "router_num_groups", "router_topk_groups",
              "rope_scaling")  # fmt: skip
    assert [getattr(from_gguf, f) for f in fields] == [getattr(from_json, f) for f in fields]
    assert from_gguf.rope_interleaved
    if kind == "plain":
        return
    assert_chunked_logits_match(str(path), hf)
    assert_recurrent_engine_matches_transformers(str(path), hf, MAX_NEW)
