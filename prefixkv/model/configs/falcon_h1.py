"""Falcon-H1 (model/falcon_h1.py: a Mamba2 mixer and attention side by side in every layer, muP
multipliers throughout): its config.json reader and its muP multipliers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from ..layer_kinds import HYBRID
from .family import ConfigFamily
from .mamba2 import hf_hybrid_fields


@dataclass(frozen=True)
class MupMultipliers:
    """Falcon-H1's muP scalars (1: none). The model folds each into a weight at load, but the
    logits' where the head is tied (it shares the embedding's weight)."""

    embedding: float = 1.0  # the input embeddings
    lm_head: float = 1.0  # the logits
    attention_in: float = 1.0  # attention's input (q, k, v)
    key: float = 1.0  # k, before rotary
    attention_out: float = 1.0  # o_proj's output
    ssm_in: float = 1.0  # the mixer's input
    ssm_out: float = 1.0  # the mixer's output
    # the mixer's in_proj output, by part: gate, x, B, C, dt
    ssm_parts: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)
    mlp_gate: float = 1.0  # the MLP's gate projection, before the activation
    mlp_down: float = 1.0  # the MLP's output


def _hf_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    """A Falcon-H1 config.json (transformers' FalconH1Config names and defaults) as ModelConfig
    fields."""
    d_ssm = d.get("mamba_d_ssm", 1024)
    ssm_intermediate = int(d.get("mamba_expand", 2) * int(d.get("hidden_size", 4096))) if d_ssm is None else int(d_ssm)
    fields = hf_hybrid_fields(d, arch, ssm_intermediate, (("projectors_bias", False), ("mamba_proj_bias", False)))
    if not d.get("mamba_rms_norm", False):
        ssm_norm = "none"
    else:
        ssm_norm = "norm_then_gate" if d.get("mamba_norm_before_gate", True) else "gate_then_norm"
    mlp = d.get("mlp_multipliers") or (1.0, 1.0)
    ssm_parts = d.get("ssm_multipliers") or (1.0,) * 5
    if len(mlp) != 2 or len(ssm_parts) != 5:
        raise ValueError(f"{arch} needs 2 mlp_multipliers and 5 ssm_multipliers, got {mlp!r} and {ssm_parts!r}")

    def scalar(key: str) -> float:
        value = d.get(key)
        return 1.0 if value is None else float(value)

    mup = MupMultipliers(
        embedding=scalar("embedding_multiplier"),
        lm_head=scalar("lm_head_multiplier"),
        attention_in=scalar("attention_in_multiplier"),
        key=scalar("key_multiplier"),
        attention_out=scalar("attention_out_multiplier"),
        ssm_in=scalar("ssm_in_multiplier"),
        ssm_out=scalar("ssm_out_multiplier"),
        ssm_parts=cast(tuple[float, float, float, float, float], tuple(float(m) for m in ssm_parts)),
        mlp_gate=float(mlp[0]),
        mlp_down=float(mlp[1]),
    )
    if mup.embedding == 0:
        raise ValueError(f"{arch} with embedding_multiplier 0 is not supported")
    fields.update(
        partial_rotary_factor=float((d.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)),
        max_position_embeddings=int(d.get("max_position_embeddings", 8192)),
        layer_types=[HYBRID] * fields["num_hidden_layers"],
        ssm_norm=ssm_norm,
        mup=mup,
    )
    return fields


FAMILY = ConfigFamily(
    architectures=("FalconH1ForCausalLM",),
    hf_fields=_hf_fields,
    model_types={"falcon_h1": "FalconH1ForCausalLM"},
)
