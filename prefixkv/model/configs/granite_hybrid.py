"""Granite 4 (model/granite_hybrid.py: Bamba's Mamba2 and attention layers, Granite's
multipliers, a shared MLP beside optional routed experts): its config.json reader, with
transformers' GraniteMoeHybridConfig defaults, and its GGUF reader (llama.cpp's "granitehybrid")."""

from __future__ import annotations

from typing import Any

from ..layer_kinds import FULL_ATTENTION, MAMBA
from .decoder import gguf_decoder_fields, gguf_granite_scales, gguf_layers_with_attention
from .family import ConfigFamily
from .mamba2 import hf_hybrid_fields

# a layer's kind in config.json: transformers 5's names, and the released checkpoints' older ones
_KINDS = {"linear_attention": MAMBA, "mamba": MAMBA, "attention": FULL_ATTENTION, "full_attention": FULL_ATTENTION}


def _hf_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    hidden = int(d.get("hidden_size", 4096))
    fields = hf_hybrid_fields(d, arch, int(d.get("mamba_expand", 2)) * hidden, ())
    n = fields["num_hidden_layers"]
    kinds = list(d.get("layer_types") or d.get("layers_block_type") or ["linear_attention"] * n)
    unknown = sorted(set(kinds) - set(_KINDS))
    if unknown or len(kinds) != n:
        raise ValueError(f"{arch} with layer_types {kinds!r}: expected {n} of {', '.join(_KINDS)}")
    layer_types = [_KINDS[k] for k in kinds]
    position = d.get("position_embedding_type")
    if position not in (None, "rope", "nope"):
        raise ValueError(f"{arch} with position_embedding_type={position!r} is not supported (rope, or none)")
    experts = int(d.get("num_local_experts", 8) or 0)
    shared = int(d.get("shared_intermediate_size", 1024))
    fields.update(
        layer_types=layer_types,
        max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        ssm_use_bias=bool(d.get("mamba_proj_bias", False)),
        # every attention layer without rotary unless the config says rope
        nope_layers=() if position == "rope" else tuple(i for i, k in enumerate(layer_types) if k == FULL_ATTENTION),
        embedding_multiplier=float(d.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(d.get("residual_multiplier", 1.0)),
        attention_multiplier=float(d.get("attention_multiplier", 1.0)),
        logits_scaling=float(d.get("logits_scaling", 1.0)),
        # the shared MLP is the layer's dense MLP, or the ungated shared expert beside routed ones
        intermediate_size=shared if not experts else int(d.get("intermediate_size", 11008)),
        num_experts=experts,
        num_experts_per_tok=int(d.get("num_experts_per_tok", 2)) if experts else 0,
        moe_intermediate_size=int(d.get("intermediate_size", 11008)) if experts else 0,
        norm_topk_prob=True,  # a softmax over the top-k logits
        shared_expert_intermediate_size=shared if experts else 0,
        shared_expert_gated=False,
    )
    if MAMBA not in layer_types:  # attention in every layer: no mixer, no state
        fields["ssm_state_size"] = 0
    return fields


def _gguf_fields(meta: dict[str, Any], tensor_names: set[str], g_arch: str, arch: str) -> dict[str, Any]:
    """A Granite 4 GGUF file (convert_hf_to_gguf.py GraniteHybridModel) as llama.cpp reads it:
    `attention.head_count_kv` per layer, 0 on a Mamba2 layer; the mixers' sizes in `ssm.*`; rotary
    only where `rope.scaling.finetuned` says (the released checkpoints: NoPE); Granite's scales,
    llama.cpp's defaults where one is missing; routed experts and the ungated shared MLP
    (`expert_shared_feed_forward_length`), or that MLP alone without experts."""
    p = g_arch + "."
    scalar, attention = gguf_layers_with_attention(meta, g_arch)
    layer_types = [FULL_ATTENTION if a else MAMBA for a in attention]
    fields = gguf_decoder_fields(scalar, tensor_names, g_arch, arch)
    mamba = [i for i, k in enumerate(layer_types) if k == MAMBA]
    if mamba:
        heads, inner = int(meta[p + "ssm.time_step_rank"]), int(meta[p + "ssm.inner_size"])
        fields.update(
            ssm_state_size=int(meta[p + "ssm.state_size"]),
            ssm_num_heads=heads,
            ssm_head_dim=inner // heads,
            ssm_intermediate_size=inner,
            ssm_n_groups=int(meta.get(p + "ssm.group_count") or 1),
            ssm_conv_kernel=int(meta.get(p + "ssm.conv_kernel") or 4),
            ssm_use_conv_bias=f"blk.{mamba[0]}.ssm_conv1d.bias" in tensor_names,
            ssm_use_bias=f"blk.{mamba[0]}.ssm_in.bias" in tensor_names,
        )
    experts = int(meta.get(p + "expert_count") or 0)
    shared = int(meta.get(p + "expert_shared_feed_forward_length") or 0)
    if not experts and not shared:
        raise ValueError(f"GGUF {p} file without {p}expert_shared_feed_forward_length (its MLP's width)")
    rope = bool(meta.get(p + "rope.scaling.finetuned", False))
    fields.update(
        layer_types=layer_types,
        nope_layers=() if rope else tuple(i for i, k in enumerate(layer_types) if k == FULL_ATTENTION),
        **gguf_granite_scales(meta, g_arch, fields["head_dim"]),
        intermediate_size=shared if not experts else fields["intermediate_size"],
        num_experts=experts,
        num_experts_per_tok=int(meta.get(p + "expert_used_count") or 0) if experts else 0,
        moe_intermediate_size=fields["intermediate_size"] if experts else 0,
        norm_topk_prob=True,
        shared_expert_intermediate_size=shared if experts else 0,
        shared_expert_gated=False,
    )
    return fields


FAMILY = ConfigFamily(
    architectures=("GraniteMoeHybridForCausalLM",),
    hf_fields=_hf_fields,
    model_types={"granitemoehybrid": "GraniteMoeHybridForCausalLM"},
    gguf_architectures={"granitehybrid": "GraniteMoeHybridForCausalLM"},
    gguf_fields=_gguf_fields,
)
