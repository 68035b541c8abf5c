"""The Llama decoder's dense architectures (Llama, Mistral, Qwen2, Qwen3): their config.json and
GGUF readers."""

from __future__ import annotations

from typing import Any

from ..layer_kinds import FULL_ATTENTION, SLIDING_ATTENTION
from .common import join_fields
from .decoder import check_silu, every_layer_slides, gguf_decoder_fields, hf_decoder_fields, window_if_sliding
from .family import ConfigFamily
from .moe import gguf_moe_fields
from .rope import rope_settings


def _hf_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    rope_theta, scaling, _ = rope_settings(d)
    window, layer_types = _attention_layers(d, arch)
    attention_bias = True if arch == "Qwen2ForCausalLM" else bool(d.get("attention_bias", False))
    check_silu(d, arch)
    return hf_decoder_fields(
        d, arch, rope_theta, scaling, window, layer_types, attention_bias, qk_norm=arch == "Qwen3ForCausalLM"
    )


def _attention_layers(d: dict[str, Any], arch: str) -> tuple[int | None, list[str]]:
    """(window, per-layer attention kinds) as transformers reads them: Mistral slides on every
    layer; Qwen2 / Qwen3 with `use_sliding_window` from layer `max_window_layers` on (an explicit
    `layer_types` list wins); Llama has no window (transformers ignores the key)."""
    if arch == "MistralForCausalLM":
        return every_layer_slides(d, arch)
    n = d["num_hidden_layers"]
    layer_types = list(d.get("layer_types") or [])
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        window = d.get("sliding_window") if d.get("use_sliding_window") else None
        if not layer_types:
            first = d.get("max_window_layers", n)
            layer_types = [SLIDING_ATTENTION if window is not None and i >= first else FULL_ATTENTION for i in range(n)]
        return window_if_sliding(window, layer_types)
    if SLIDING_ATTENTION in layer_types:
        raise ValueError(f"{arch} with sliding_attention layers is not supported")
    return None, []


def _gguf_fields(meta: dict[str, Any], tensor_names: set[str], g_arch: str, arch: str) -> dict[str, Any]:
    experts = gguf_moe_fields(g_arch, meta, tensor_names)
    if g_arch == "llama" and experts:
        arch = "MixtralForCausalLM"  # llama.cpp writes Mixtral as "llama" with expert tensors
    return join_fields(gguf_decoder_fields(meta, tensor_names, g_arch, arch), experts)


FAMILY = ConfigFamily(
    architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"),
    hf_fields=_hf_fields,
    model_types={
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    },
    gguf_architectures={
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    },
    gguf_fields=_gguf_fields,
)
