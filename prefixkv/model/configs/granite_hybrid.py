"""Granite 4 (model/granite_hybrid.py: Bamba's Mamba2 and attention layers, Granite's
multipliers, a shared MLP beside optional routed experts): its config.json reader, with
transformers' GraniteMoeHybridConfig defaults."""

from __future__ import annotations

from typing import Any

from ..layer_kinds import FULL_ATTENTION, MAMBA
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


FAMILY = ConfigFamily(
    architectures=("GraniteMoeHybridForCausalLM",),
    hf_fields=_hf_fields,
    model_types={"granitemoehybrid": "GraniteMoeHybridForCausalLM"},
)
