"""Qwen3-Next (model/qwen3_next.py: gated delta net layers and gated full attention, MoE MLPs) and
Qwen3.5 (model/qwen3_5.py: the same decoder; dense MLPs, or routed experts in every layer): their
config.json and GGUF readers (llama.cpp's qwen3next, qwen35, qwen35moe; the tensors:
model/gguf_delta_net.py)."""

from __future__ import annotations

from typing import Any

from ..layer_kinds import FULL_ATTENTION, LINEAR_ATTENTION
from .common import join_fields
from .decoder import gguf_decoder_fields
from .family import ConfigFamily
from .moe import gguf_moe_fields
from .rope import rope_settings

# Qwen3.5's released checkpoints: the language model under a vision encoder, served text-only here
VISION_LANGUAGE = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}


def _hf_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    if arch in VISION_LANGUAGE:
        text = dict(d.get("text_config") or {})
        if "tie_word_embeddings" in d:  # the outer config's, as transformers ties them
            text["tie_word_embeddings"] = d["tie_word_embeddings"]
        return {**_text_fields(text, VISION_LANGUAGE[arch]), "architecture": arch}
    return _text_fields(d, arch)


def _text_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    """A Qwen3-Next config.json (transformers' Qwen3NextConfig names and defaults) as ModelConfig
    fields: gated delta net layers and gated full attention layers (q/k norm, rotary over the first
    quarter of each head), a mixture-of-experts MLP with a gated shared expert where
    `decoder_sparse_step` / `mlp_only_layers` say, a dense one elsewhere."""
    hidden = int(d.get("hidden_size", 2048))
    n_layers = int(d.get("num_hidden_layers", 48))
    n_heads = int(d.get("num_attention_heads", 16))
    # Qwen3.5's configs say attn_output_gate (true in every release); the gate is always applied here
    for key, supported in (("hidden_act", "silu"), ("attention_bias", False), ("attn_output_gate", True)):
        if d.get(key, supported) != supported:
            raise ValueError(f"{arch} with {key}={d.get(key)!r} is not supported ({supported!r} only)")
    layer_types = list(d.get("layer_types") or [])
    if not layer_types:
        interval = int(d.get("full_attention_interval", 4))
        layer_types = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(n_layers)]
    unknown = sorted(set(layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION})
    if unknown:
        raise ValueError(f"{arch} with layer type(s) {unknown} is not supported (linear_attention, full_attention)")
    rope_theta, scaling, _ = rope_settings(d)
    if scaling is not None:
        raise ValueError(f"{arch} with rope scaling {scaling!r} is not supported")
    rope_params = d.get("rope_parameters") or {}
    # transformers' Qwen3NextConfig takes 0.25 where neither place says
    partial = rope_params.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))
    # Qwen3.5's dense config has no experts, its MoE one every layer routed (no sparse step, no
    # dense layers, top-k weights always renormalised: transformers' Qwen3_5Moe router)
    num_experts = int(d.get("num_experts", 0 if arch == "Qwen3_5ForCausalLM" else 512))
    if arch == "Qwen3_5MoeForCausalLM":
        d = {**d, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
    return dict(
        architecture=arch,
        vocab_size=int(d.get("vocab_size", 151936)),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=int(d.get("num_key_value_heads") or 2),
        head_dim=int(d.get("head_dim") or 256),
        intermediate_size=int(d.get("intermediate_size", 5632)),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        partial_rotary_factor=float(partial),
        max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qk_norm=True,
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id", []),
        layer_types=layer_types,
        num_experts=num_experts,
        num_experts_per_tok=int(d.get("num_experts_per_tok", 10)) if num_experts else 0,
        moe_intermediate_size=int(d.get("moe_intermediate_size", 512)) if num_experts else 0,
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size", 512)) if num_experts else 0,
        decoder_sparse_step=int(d.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()),
        linear_num_key_heads=int(d.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(d.get("linear_num_value_heads", 32)) if LINEAR_ATTENTION in layer_types else 0,
        linear_key_head_dim=int(d.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(d.get("linear_value_head_dim", 128)),
        linear_conv_kernel=int(d.get("linear_conv_kernel_dim", 4)),
    )


def _gguf_fields(meta: dict[str, Any], tensor_names: set[str], g_arch: str, arch: str) -> dict[str, Any]:
    """A Qwen3-Next / Qwen3.5 GGUF file as llama.cpp reads it: a full attention layer every
    `full_attention_interval`-th, rotary over `rope.dimension_count` of each head (Qwen3.5's
    multimodal sections are the plain rotary over text), the delta nets' sizes in the `ssm.*`
    keys, the top-k expert weights renormalised, and the last `nextn_predict_layers` blocks (the
    multi-token-prediction head) not counted."""
    p = g_arch + "."
    blocks = int(meta[p + "block_count"]) - int(meta.get(p + "nextn_predict_layers") or 0)
    fields = gguf_decoder_fields(meta, tensor_names, g_arch, arch, partial_rotary=True)
    if fields["rope_scaling"] is not None:
        raise ValueError(f"{arch} with rope scaling {fields['rope_scaling']!r} is not supported")
    if fields["attention_bias"]:
        raise ValueError(f"{arch} with attention biases is not supported")
    interval = int(meta.get(p + "full_attention_interval") or 4)
    v_heads = int(meta[p + "ssm.time_step_rank"])
    experts = gguf_moe_fields(g_arch, meta, tensor_names)
    if experts:
        experts["norm_topk_prob"] = True  # llama.cpp renormalises Qwen3-Next's and Qwen3.5's top k
        experts["decoder_sparse_step"] = 1
    fields.update(
        partial_rotary_factor=int(meta.get(p + "rope.dimension_count") or fields["head_dim"]) / fields["head_dim"],
        qk_norm=True,
        layer_types=[LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(blocks)],
        linear_num_key_heads=int(meta[p + "ssm.group_count"]),
        linear_num_value_heads=v_heads,
        linear_key_head_dim=int(meta[p + "ssm.state_size"]),
        linear_value_head_dim=int(meta[p + "ssm.inner_size"]) // v_heads,
        linear_conv_kernel=int(meta.get(p + "ssm.conv_kernel") or 4),
    )
    return join_fields(fields, experts)


FAMILY = ConfigFamily(
    architectures=("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", *VISION_LANGUAGE),
    hf_fields=_hf_fields,
    model_types={
        "qwen3_next": "Qwen3NextForCausalLM",
        "qwen3_5_text": "Qwen3_5ForCausalLM",
        "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
        "qwen3_5": "Qwen3_5ForConditionalGeneration",
        "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    },
    gguf_architectures={
        "qwen3next": "Qwen3NextForCausalLM",
        "qwen35": "Qwen3_5ForCausalLM",
        "qwen35moe": "Qwen3_5MoeForCausalLM",
    },
    gguf_fields=_gguf_fields,
)
