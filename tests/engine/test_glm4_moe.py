"""GLM-4.5 (transformers' Glm4MoeForCausalLM) and MiniMax-M2 (MiniMaxM2ForCausalLM) through the
model and the whole engine, against transformers on tiny random checkpoints: logits over chunks
split mid-block and a decode equal, greedy tokens equal with caching off and on, under chunked
prefill and preemption, every block free afterwards. Both route by a sigmoid router whose
selection bias is randomised (so that it changes the choice); GLM-4.5's also limits the choice
to the best groups and keeps an ungated shared expert; MiniMax-M2 norms q and k over the whole
projection. Each checkpoint carries a multi-token-prediction layer after the last, as the
released ones do, which is not the model's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from prefixkv.model import ModelConfig, load_model
from prefixkv.model.llama import ProjectionNormedAttention
from prefixkv.model.moe import SparseMoeBlock

from ..model.test_model_hf_folder import _write_tokenizer
from .engine_oracle import assert_engine_matches_transformers
from .test_qwen3_5 import assert_chunked_logits_match

MAX_NEW = 8


def _randomise(model, router_bias: str) -> None:
    """Weights larger than the init's, so that norms, routers and rotary matter; each layer's
    selection bias random (a buffer: named_buffers)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1, 0.1)
            elif ".gate." in name or "q_proj" in name or "k_proj" in name:
                p.normal_(0, 0.3)
            else:
                p.normal_(0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith(router_bias):
                b.normal_(0, 0.3)


def make_glm4_moe(seed: int = 0):
    """A dense first layer, then 8 experts in 4 groups (the best 2 of them open), top 3, two
    shared experts' width, q/k norms, q/k/v biases, rotary over half of each head."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    torch.manual_seed(seed)
    config = Glm4MoeConfig(
        vocab_size=258, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, n_routed_experts=8, num_experts_per_tok=3,
        n_group=4, topk_group=2, n_shared_experts=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
        use_qk_norm=True, attention_bias=True, max_position_embeddings=256, bos_token_id=256, eos_token_id=257,
        pad_token_id=257, attn_implementation="eager",
    )  # fmt: skip
    model = Glm4MoeForCausalLM(config).eval()
    _randomise(model, "e_score_correction_bias")
    return model


def make_minimax_m2(seed: int = 0):
    """8 experts, top 2, in every layer; rotary over the first 16 of each head's 32 dimensions."""
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    torch.manual_seed(seed)
    config = MiniMaxM2Config(
        vocab_size=258, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, rotary_dim=16, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=256, bos_token_id=256, eos_token_id=257, pad_token_id=257,
        attn_implementation="eager",
    )  # fmt: skip
    model = MiniMaxM2ForCausalLM(config).eval()
    _randomise(model, "e_score_correction_bias")
    return model


def _save_with_prediction_layer(hf, folder: Path) -> str:
    """The checkpoint as transformers saves it, plus a multi-token-prediction layer after the last
    (as GLM-4.5's and MiniMax-M2's releases append one): tensors no layer of the model takes."""
    hf.save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    n = hf.config.num_hidden_layers
    tensors[f"model.layers.{n}.eh_proj.weight"] = torch.randn(64, 128)
    tensors[f"model.layers.{n}.self_attn.q_proj.weight"] = torch.randn(128, 64)
    save_file(tensors, path, metadata={"format": "pt"})
    return str(folder)


@pytest.mark.parametrize("family", ["glm4_moe", "minimax_m2"])
def test_logits_match_transformers(tmp_path, family):
    """One prefill in two chunks (the second starting mid-block), then a decode step."""
    hf = make_glm4_moe() if family == "glm4_moe" else make_minimax_m2()
    folder = _save_with_prediction_layer(hf, tmp_path)
    config = ModelConfig.from_hf_folder(folder)
    assert config.rotary_dim == 16 and config.router_scoring == "sigmoid" and config.router_selection_bias
    model = load_model(folder).model
    if family == "glm4_moe":
        assert config.qk_norm and config.attention_bias and config.mlp_only_layers == (0,)
        assert (config.router_num_groups, config.router_topk_groups, config.routed_scaling_factor) == (4, 2, 2.5)
        assert config.shared_expert_intermediate_size == 64 and not config.shared_expert_gated
        assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers] == [False, True, True]
    else:
        assert not config.qk_norm and config.num_experts == 8 and config.moe_intermediate_size == 32
        assert all(type(layer.self_attn) is ProjectionNormedAttention for layer in model.layers)
    assert model.layers[1].mlp.expert_bias.dtype == torch.float32
    assert_chunked_logits_match(folder, hf)


@pytest.mark.parametrize("family", ["glm4_moe", "minimax_m2"])
def test_engine_matches_transformers(tmp_path, family):
    hf = make_glm4_moe() if family == "glm4_moe" else make_minimax_m2()
    assert_engine_matches_transformers(tmp_path, hf, family, MAX_NEW)


def test_group_limited_choice_is_read_and_checked():
    """The groups must divide the experts and hold at least top k; DeepSeek-V3's group worth is
    the sum of a group's two best scores, so each group holds two experts at least."""
    base = dict(architecture="Glm4MoeForCausalLM", vocab_size=8, hidden_size=8, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, intermediate_size=8, num_experts=8,
                num_experts_per_tok=4, moe_intermediate_size=4)  # fmt: skip
    assert ModelConfig(**base, router_num_groups=4, router_topk_groups=2).router_topk_groups == 2
    for groups, best in ((3, 1), (4, 1), (8, 4), (4, 5)):
        with pytest.raises(ValueError, match="router groups"):
            ModelConfig(**base, router_num_groups=groups, router_topk_groups=best)


@pytest.mark.parametrize(
    "setting",
    [dict(scoring_func="softmax"), dict(attn_type_list=[0, 1]), dict(shared_intermediate_size=64),
     dict(use_routing_bias=False)],
)  # fmt: skip
def test_minimax_m2_settings_not_built_are_refused(setting):
    d = make_minimax_m2().config.to_dict()
    d.update(architectures=["MiniMaxM2ForCausalLM"], **setting)
    with pytest.raises(ValueError, match=next(iter(setting))):
        ModelConfig.from_hf_dict(d)


@pytest.mark.parametrize("family", ["glm4_moe", "minimax_m2"])
def test_gguf_matches_transformers(tmp_path, family):
    """A GGUF file by llama.cpp's converter rules (the experts stacked, the selection bias as
    exp_probs_b, GLM-4.5's router keys and a prediction layer counted in block_count): the config
    read as from config.json, then logits and the engine's greedy tokens against transformers."""
    from ..model.gguf_convert import write_sigmoid_moe_gguf
    from .engine_oracle import assert_recurrent_engine_matches_transformers

    hf = make_glm4_moe() if family == "glm4_moe" else make_minimax_m2()
    folder = tmp_path / "hf"
    _save_with_prediction_layer(hf, folder)
    path = tmp_path / f"{family}.gguf"
    write_sigmoid_moe_gguf(path, hf, mtp_blocks=1 if family == "glm4_moe" else 0)
    from_json, from_gguf = ModelConfig.from_hf_folder(str(folder)), load_model(str(path)).config
    fields = ("num_hidden_layers", "rotary_dim", "qk_norm", "attention_bias", "num_experts", "num_experts_per_tok",
              "moe_intermediate_size", "mlp_only_layers", "norm_topk_prob", "router_scoring", "router_selection_bias",
              "routed_scaling_factor", "shared_expert_intermediate_size", "router_scores_float32",
              "router_num_groups", "router_topk_groups")  # fmt: skip
    assert [getattr(from_gguf, f) for f in fields] == [getattr(from_json, f) for f in fields]
    if family == "glm4_moe":
        assert not from_gguf.shared_expert_gated and from_gguf.router_logits_float32
    assert_chunked_logits_match(str(path), hf)
    assert_recurrent_engine_matches_transformers(str(path), hf, MAX_NEW)
