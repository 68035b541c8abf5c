"""GLM-4 (model/glm4.py: sandwich-normed blocks, GLM's interleaved rotary over half of each head):
its config.json reader, with transformers' Glm4Config defaults."""

from __future__ import annotations

from typing import Any

from .decoder import check_silu, hf_decoder_fields
from .family import ConfigFamily
from .rope import rope_settings


def _hf_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    d = {"head_dim": 128, "rms_norm_eps": 1.5625e-07, **d}
    rope_theta, scaling, _ = rope_settings(d)
    check_silu(d, arch)
    fields = hf_decoder_fields(
        d, arch, rope_theta, scaling, None, [], attention_bias=bool(d.get("attention_bias", True)), qk_norm=False
    )
    rope = d.get("rope_parameters") or {}
    fields.update(
        partial_rotary_factor=float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.5))),
        rope_interleaved=True,
    )
    return fields


FAMILY = ConfigFamily(
    architectures=("Glm4ForCausalLM",),
    hf_fields=_hf_fields,
    model_types={"glm4": "Glm4ForCausalLM"},
)
