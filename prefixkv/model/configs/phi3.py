"""Phi-3 and Phi-4 (dense; Phi3ForCausalLM): the Llama decoder with q/k/v and gate/up fused in the
checkpoint (model/phi3.py splits them), rotary over a share of each head
(`partial_rotary_factor`), LongRoPE's scaling (its short factors: ModelConfig.exact_context) and
Mistral's window on every layer where `sliding_window` is shorter than the context."""

from __future__ import annotations

from typing import Any

from .decoder import check_silu, hf_decoder_fields
from .family import ConfigFamily
from .rope import rope_settings


def _hf_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    rope_theta, scaling, _ = rope_settings(d)
    check_silu(d, arch)
    if d.get("attention_bias"):
        raise ValueError(f"{arch} with attention_bias=true is not supported")
    window = d.get("sliding_window")
    longest = int(d.get("max_position_embeddings", 4096))
    if window is not None and int(window) >= longest:
        window = None  # a window as long as the context hides nothing (Phi-4-mini's 262,144)
    fields = hf_decoder_fields(d, arch, rope_theta, scaling, window, [], attention_bias=False, qk_norm=False)
    rope_params = d.get("rope_parameters") or {}
    fields["partial_rotary_factor"] = float(
        rope_params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    )
    fields["rms_norm_eps"] = float(d.get("rms_norm_eps", 1e-5))
    return fields


FAMILY = ConfigFamily(
    architectures=("Phi3ForCausalLM",),
    hf_fields=_hf_fields,
    model_types={"phi3": "Phi3ForCausalLM"},
)
