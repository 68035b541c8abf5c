"""LFM2 and LFM2-MoE (model/lfm2.py: gated short convolutions and GQA attention layers; routed
experts): their config.json reader, with transformers' Lfm2Config defaults (the MLP's width adjusted as its
`block_auto_adjust_ff_dim` says), and its GGUF reader (llama.cpp's "lfm2")."""

from __future__ import annotations

from typing import Any

from ..layer_kinds import FULL_ATTENTION, SHORT_CONV
from .decoder import gguf_decoder_fields, gguf_layers_with_attention, hf_decoder_fields
from .family import ConfigFamily
from .rope import rope_settings


def mlp_width(d: dict[str, Any]) -> int:
    """transformers' Lfm2MLP width: 2/3 of `intermediate_size` (`block_ff_dim`), times
    `block_ffn_dim_multiplier`, rounded up to `block_multiple_of`, where `block_auto_adjust_ff_dim`."""
    width = int(d.get("intermediate_size") or d.get("block_ff_dim") or 12288)
    if not d.get("block_auto_adjust_ff_dim", True):
        return width
    width = int(2 * width / 3)
    multiplier = d.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is not None:
        multiple = int(d.get("block_multiple_of", 256))
        width = int(multiplier * width)
        width = multiple * ((width + multiple - 1) // multiple)
    return width


def _hf_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    d = dict(d)
    n = int(d["num_hidden_layers"])
    layer_types = list(d.get("layer_types") or [])
    if not layer_types:
        full = d.get("full_attn_idxs")
        full = set(range(n)) if full is None else {int(i) for i in full}
        layer_types = [FULL_ATTENTION if i in full else SHORT_CONV for i in range(n)]
    unknown = sorted(set(layer_types) - {FULL_ATTENTION, SHORT_CONV})
    if unknown:
        raise ValueError(f"{arch} with layer type(s) {unknown} is not supported (conv, full_attention)")
    rope_theta, scaling, _ = rope_settings(d, default_theta=1000000.0)
    d.setdefault("tie_word_embeddings", d.get("tie_embedding", True))
    d["intermediate_size"] = mlp_width(d)
    d["rms_norm_eps"] = float(d.get("norm_eps", 1e-5))
    fields = hf_decoder_fields(d, arch, rope_theta, scaling, None, layer_types, attention_bias=False, qk_norm=True)
    fields.update(
        tie_word_embeddings=bool(d["tie_word_embeddings"]),
        short_conv_kernel=int(d.get("conv_L_cache", 3)) if SHORT_CONV in layer_types else 0,
        short_conv_bias=bool(d.get("conv_bias", False)),
    )
    return fields


def _gguf_fields(meta: dict[str, Any], tensor_names: set[str], g_arch: str, arch: str) -> dict[str, Any]:
    """An LFM2 GGUF file (convert_hf_to_gguf.py LFM2Model): `attention.head_count_kv` per layer,
    0 on a convolution layer; the convolution's length `shortconv.l_cache`; the MLP's width
    already adjusted."""
    p = g_arch + "."
    scalar, attention = gguf_layers_with_attention(meta, g_arch)
    if not any(attention):
        raise ValueError(f"GGUF {p}attention.head_count_kv: no attention layer")
    fields = gguf_decoder_fields(scalar, tensor_names, g_arch, arch)
    layer_types = [FULL_ATTENTION if a else SHORT_CONV for a in attention]
    conv_layer = layer_types.index(SHORT_CONV) if SHORT_CONV in layer_types else 0
    fields.update(
        layer_types=layer_types,
        qk_norm=True,
        short_conv_kernel=int(meta[p + "shortconv.l_cache"]) if SHORT_CONV in layer_types else 0,
        short_conv_bias=f"blk.{conv_layer}.shortconv.in_proj.bias" in tensor_names,
    )
    return fields


def _moe_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    """LFM2-MoE (transformers' Lfm2MoeConfig names and defaults): LFM2's layers, the first
    `num_dense_layers` with a dense MLP of `intermediate_size` (not adjusted), the rest routed
    experts: a sigmoid router, the top k chosen with the per-expert bias, weights renormalised
    (+ 1e-6) and scaled."""
    d = {"intermediate_size": 7168, "block_auto_adjust_ff_dim": False, "num_hidden_layers": 32, **d}
    fields = _hf_fields(d, arch)
    experts = int(d.get("num_experts", 32))
    fields.update(
        num_experts=experts,
        num_experts_per_tok=int(d.get("num_experts_per_tok", 4)),
        moe_intermediate_size=int(d.get("moe_intermediate_size", 1792)),
        mlp_only_layers=tuple(range(int(d.get("num_dense_layers", 2)))),
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        router_scoring="sigmoid",
        router_selection_bias=bool(d.get("use_expert_bias", True)),
        router_norm_epsilon=1e-6,
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
    )
    return fields


def _fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    return _moe_fields(d, arch) if arch == "Lfm2MoeForCausalLM" else _hf_fields(d, arch)


FAMILY = ConfigFamily(
    architectures=("Lfm2ForCausalLM", "Lfm2MoeForCausalLM"),
    hf_fields=_fields,
    model_types={"lfm2": "Lfm2ForCausalLM", "lfm2_moe": "Lfm2MoeForCausalLM"},
    gguf_architectures={"lfm2": "Lfm2ForCausalLM"},
    gguf_fields=_gguf_fields,
)
