"""The mixture-of-experts architectures (Mixtral, Qwen2-MoE, Qwen3-MoE: the Llama decoder with
model/moe.py's MLP): their config.json and GGUF readers, and the expert fields of any GGUF."""

from __future__ import annotations

from typing import Any

from ..layer_kinds import SLIDING_ATTENTION
from .common import join_fields
from .decoder import check_silu, every_layer_slides, gguf_decoder_fields, hf_decoder_fields
from .family import ConfigFamily
from .rope import rope_settings


def _hf_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    rope_theta, scaling, _ = rope_settings(d)
    if arch == "MixtralForCausalLM":
        window, layer_types = every_layer_slides(d, arch)
    else:
        if (d.get("use_sliding_window") and d.get("sliding_window") is not None) or SLIDING_ATTENTION in (
            d.get("layer_types") or []
        ):
            raise ValueError(f"{arch} with sliding-window layers is not supported")
        window, layer_types = None, []
    if arch == "Qwen2MoeForCausalLM":
        attention_bias = bool(d.get("qkv_bias", True))
    else:
        attention_bias = bool(d.get("attention_bias", False))
    check_silu(d, arch)
    qk_norm = arch == "Qwen3MoeForCausalLM"
    return join_fields(
        hf_decoder_fields(d, arch, rope_theta, scaling, window, layer_types, attention_bias, qk_norm),
        _hf_moe_fields(d, arch),
    )


def _hf_moe_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    """The expert fields of an HF config. transformers 5 writes Qwen3-MoE's expert count as
    `num_local_experts`, the published checkpoints as `num_experts`: either is read."""
    if arch == "MixtralForCausalLM":
        return {
            "num_experts": int(d.get("num_local_experts") or d.get("num_experts") or 0),
            "num_experts_per_tok": int(d.get("num_experts_per_tok", 2)),
            "moe_intermediate_size": int(d["intermediate_size"]),
            "norm_topk_prob": True,  # Mixtral always renormalises its top-k
        }
    fields = {
        "num_experts": int(d.get("num_experts") or d.get("num_local_experts") or 0),
        "num_experts_per_tok": int(d.get("num_experts_per_tok", 0)),
        "moe_intermediate_size": int(d.get("moe_intermediate_size", 0)),
        "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
        "decoder_sparse_step": int(d.get("decoder_sparse_step", 1)),
        "mlp_only_layers": tuple(d.get("mlp_only_layers") or ()),
    }
    if arch == "Qwen2MoeForCausalLM":
        fields["shared_expert_intermediate_size"] = int(d.get("shared_expert_intermediate_size", 0))
    return fields


# llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX and _SIGMOID
GGUF_SOFTMAX_GATING, GGUF_SIGMOID_GATING = 1, 2


def gguf_moe_fields(
    g_arch: str, meta: dict[str, Any], tensor_names: set[str], gating_by_default: int = GGUF_SOFTMAX_GATING
) -> dict[str, Any]:
    """The mixture-of-experts fields of a GGUF file's metadata ({} without experts), as llama.cpp
    reads them: the top-k weights renormalised for Mixtral ("llama") and Qwen3-MoE, not for
    Qwen2-MoE, unless the file says (`expert_weights_norm`); a softmax router, or a sigmoid one
    (`expert_gating_func`, else the architecture's `gating_by_default`) scoring in float32, with
    the selection bias where the file has it (`exp_probs_b`), its groups (`expert_group_count`,
    `expert_group_used_count`) and scale (`expert_weights_scale`); a shared expert of its own width
    (`expert_shared_feed_forward_length`) or `expert_shared_count` experts' width, gated where the
    file has the shared expert's gate."""
    p = g_arch + "."
    experts = int(meta.get(p + "expert_count", 0) or 0)
    if not experts:
        if g_arch in ("qwen2moe", "qwen3moe", "qwen3next", "qwen35moe", "glm4moe", "minimax-m2"):
            raise ValueError(f"GGUF architecture {g_arch!r} without {p}expert_count")
        return {}
    norm = meta.get(p + "expert_weights_norm")
    if norm is None:
        norm = g_arch != "qwen2moe"
    gating = meta.get(p + "expert_gating_func")
    gating = gating_by_default if gating is None else int(gating)
    if gating not in (GGUF_SOFTMAX_GATING, GGUF_SIGMOID_GATING):
        raise ValueError(f"GGUF {p}expert_gating_func={gating!r} is not supported (softmax or sigmoid routing)")
    width = int(meta.get(p + "expert_feed_forward_length") or meta[p + "feed_forward_length"])
    fields: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": int(meta.get(p + "expert_used_count", 0)),
        "moe_intermediate_size": width,
        "norm_topk_prob": bool(norm),
        "routed_scaling_factor": float(meta.get(p + "expert_weights_scale") or 1.0),
        "router_num_groups": int(meta.get(p + "expert_group_count") or 1),
        "router_topk_groups": int(meta.get(p + "expert_group_used_count") or 1),
    }
    # which layers are dense: those without a router tensor
    blocks = int(meta[p + "block_count"]) - int(meta.get(p + "nextn_predict_layers") or 0)
    dense = tuple(i for i in range(blocks) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names)
    fields["mlp_only_layers"] = dense
    sparse = next((i for i in range(blocks) if i not in dense), 0)
    if gating == GGUF_SIGMOID_GATING:
        fields.update(router_scoring="sigmoid", router_logits_float32=True, router_scores_float32=True)
    if f"blk.{sparse}.exp_probs_b.bias" in tensor_names:
        fields["router_selection_bias"] = True
    if g_arch in ("qwen2moe", "qwen3next", "qwen35moe"):
        fields["shared_expert_intermediate_size"] = int(meta.get(p + "expert_shared_feed_forward_length", 0))
    elif meta.get(p + "expert_shared_count"):
        fields["shared_expert_intermediate_size"] = width * int(meta[p + "expert_shared_count"])
    if "shared_expert_intermediate_size" in fields:
        fields["shared_expert_gated"] = f"blk.{sparse}.ffn_gate_inp_shexp.weight" in tensor_names
    return fields


def _gguf_fields(meta: dict[str, Any], tensor_names: set[str], g_arch: str, arch: str) -> dict[str, Any]:
    experts = gguf_moe_fields(g_arch, meta, tensor_names)
    return join_fields(gguf_decoder_fields(meta, tensor_names, g_arch, arch), experts)


FAMILY = ConfigFamily(
    architectures=("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"),
    hf_fields=_hf_fields,
    model_types={
        "mixtral": "MixtralForCausalLM",
        "qwen2_moe": "Qwen2MoeForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
    },
    gguf_architectures={"qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"},
    gguf_fields=_gguf_fields,
)
