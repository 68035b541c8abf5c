"""Bamba (model/hybrid.py: Mamba2 layers and attention layers in one model): its config.json
reader."""

from __future__ import annotations

from typing import Any

from ..layer_kinds import FULL_ATTENTION, MAMBA
from .family import ConfigFamily
from .mamba2 import hf_hybrid_fields


def _hf_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    """A Bamba config.json (transformers' BambaConfig names and defaults) as ModelConfig fields:
    Mamba2 layers, attention (Llama's, GQA, rotary on half of each head) at `attn_layer_indices`,
    a SwiGLU MLP after either."""
    ssm_intermediate = int(d.get("mamba_expand", 2) * int(d.get("hidden_size", 4096)))
    fields = hf_hybrid_fields(d, arch, ssm_intermediate, ())
    n_layers = fields["num_hidden_layers"]
    attn = {int(i) for i in d.get("attn_layer_indices") or ()}
    if not attn <= set(range(n_layers)):
        raise ValueError(f"{arch} attn_layer_indices {sorted(attn)} outside its {n_layers} layers")
    fields.update(
        # transformers' BambaConfig takes 0.5 where rope_parameters does not say
        partial_rotary_factor=float((d.get("rope_parameters") or {}).get("partial_rotary_factor", 0.5)),
        max_position_embeddings=int(d.get("max_position_embeddings", 262144)),
        layer_types=[FULL_ATTENTION if i in attn else MAMBA for i in range(n_layers)],
        ssm_use_bias=bool(d.get("mamba_proj_bias", False)),
    )
    if len(attn) == n_layers:  # attention in every layer: no mixer, no state
        fields["ssm_state_size"] = 0
    return fields


FAMILY = ConfigFamily(
    architectures=("BambaForCausalLM",),
    hf_fields=_hf_fields,
    model_types={"bamba": "BambaForCausalLM"},
)
