"""Phi-3 and Phi-4 (dense; Phi3ForCausalLM): the Llama decoder with q/k/v and gate/up fused in the
checkpoint (model/phi3.py splits them), rotary over a share of each head
(`partial_rotary_factor`), LongRoPE's scaling (its short factors: ModelConfig.exact_context) and
Mistral's window on every layer where `sliding_window` is shorter than the context; from
config.json and from GGUF (llama.cpp's "phi3")."""

from __future__ import annotations

from typing import Any

from .decoder import check_silu, gguf_decoder_fields, hf_decoder_fields
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


# prefixkv's keys for the values of LongRoPE's factor tensors (rope_factors_long / _short.weight),
# which llama.cpp keeps as tensors, not metadata: loader.gguf_config adds them
GGUF_LONG_FACTOR, GGUF_SHORT_FACTOR = "rope.scaling.long_factor", "rope.scaling.short_factor"


def _gguf_fields(meta: dict[str, Any], tensor_names: set[str], g_arch: str, arch: str) -> dict[str, Any]:
    """A Phi-3 / Phi-4 GGUF file (convert_hf_to_gguf.py Phi3MiniModel): the head size hidden /
    heads, rotary over `rope.dimension_count` of it, LongRoPE where the file holds its factors (the
    short ones built: ModelConfig.exact_context; the attention factor as written), the window on
    every layer where it is shorter than the context (as transformers applies it)."""
    p = g_arch + "."
    if "blk.0.attn_qkv.bias" in tensor_names:
        raise ValueError(f"{arch} with attention biases is not supported")
    fields = gguf_decoder_fields(meta, tensor_names, g_arch, arch, partial_rotary=True)
    rope_dims = int(meta.get(p + "rope.dimension_count") or fields["head_dim"])
    fields["partial_rotary_factor"] = rope_dims / fields["head_dim"]
    longest = fields["max_position_embeddings"]
    window = int(meta.get(p + "attention.sliding_window") or 0)
    fields["sliding_window"] = window if 0 < window < longest else None
    long, short = meta.get(p + GGUF_LONG_FACTOR), meta.get(p + GGUF_SHORT_FACTOR)
    attention_factor = meta.get(p + "rope.scaling.attn_factor")
    if long is None or short is None:
        if attention_factor is not None:
            raise ValueError(f"GGUF {p}rope.scaling.attn_factor without LongRoPE's factor tensors is not supported")
        return fields
    original = int(meta[p + "rope.scaling.original_context_length"])
    fields["rope_scaling"] = {
        "rope_type": "longrope",
        "long_factor": list(long),
        "short_factor": list(short),
        "original_max_position_embeddings": original,
        "factor": longest / original,
        **({} if attention_factor is None else {"attention_factor": float(attention_factor)}),
    }
    return fields


FAMILY = ConfigFamily(
    architectures=("Phi3ForCausalLM",),
    hf_fields=_hf_fields,
    model_types={"phi3": "Phi3ForCausalLM"},
    gguf_architectures={"phi3": "Phi3ForCausalLM"},
    gguf_fields=_gguf_fields,
)
