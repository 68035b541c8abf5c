"""GLM-4 (model/glm4.py: sandwich-normed blocks, GLM's interleaved rotary over half of each head):
its config.json reader, with transformers' Glm4Config defaults, and its GGUF reader (llama.cpp's
"glm4")."""

from __future__ import annotations

from typing import Any

from .decoder import check_silu, gguf_decoder_fields, hf_decoder_fields
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


def _gguf_fields(meta: dict[str, Any], tensor_names: set[str], g_arch: str, arch: str) -> dict[str, Any]:
    """A GLM-4 GGUF file (convert_hf_to_gguf.py Glm4Model): the rows as transformers has them (the
    converter reorders them only for the vision model's M-RoPE, which is refused), rotary over
    `rope.dimension_count` of each head, the MLP's gate and up in one tensor (`ffn_up`)."""
    p = g_arch + "."
    if meta.get(p + "rope.dimension_sections"):
        raise ValueError(f"GGUF {p}rope.dimension_sections (GLM-4V's M-RoPE) is not supported")
    fields = gguf_decoder_fields(meta, tensor_names, g_arch, arch, partial_rotary=True)
    rope_dims = int(meta.get(p + "rope.dimension_count") or fields["head_dim"])
    fields.update(partial_rotary_factor=rope_dims / fields["head_dim"], rope_interleaved=True)
    return fields


FAMILY = ConfigFamily(
    architectures=("Glm4ForCausalLM",),
    hf_fields=_hf_fields,
    model_types={"glm4": "Glm4ForCausalLM"},
    gguf_architectures={"glm4": "Glm4ForCausalLM"},
    gguf_fields=_gguf_fields,
)
