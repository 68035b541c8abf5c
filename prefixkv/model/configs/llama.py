"""The Llama decoder's dense architectures (Llama, Mistral, Qwen2, Qwen3, SmolLM3, and Granite 3
with its multipliers: model/granite.py): their config.json and GGUF readers."""

from __future__ import annotations

from typing import Any

from ..layer_kinds import FULL_ATTENTION, SLIDING_ATTENTION
from .common import join_fields
from .decoder import (
    check_silu,
    every_layer_slides,
    gguf_decoder_fields,
    gguf_granite_scales,
    hf_decoder_fields,
    window_if_sliding,
)
from .family import ConfigFamily
from .moe import gguf_moe_fields
from .rope import rope_settings


def hf_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    if arch == "Ernie4_5ForCausalLM":
        return _ernie_fields(d, arch)
    smollm3 = arch == "SmolLM3ForCausalLM"
    rope_theta, scaling, _ = rope_settings(d, 2_000_000.0 if smollm3 else 10000.0)
    window, layer_types = _attention_layers(d, arch)
    attention_bias = True if arch == "Qwen2ForCausalLM" else bool(d.get("attention_bias", False))
    check_silu(d, arch)
    if d.get("mlp_bias"):
        raise ValueError(f"{arch} with mlp_bias=true is not supported")
    fields = hf_decoder_fields(
        d, arch, rope_theta, scaling, window, layer_types, attention_bias, qk_norm=arch == "Qwen3ForCausalLM",
        tie_by_default=smollm3,
    )  # fmt: skip
    # transformers' Llama, Qwen3 and SmolLM3 give the output projection a bias with the others'
    # (Qwen2's and Mistral's never have one)
    fields["attention_output_bias"] = attention_bias and arch not in ("Qwen2ForCausalLM", "MistralForCausalLM")
    if smollm3:
        fields["nope_layers"] = _nope_layers(d)
    if arch == "GraniteForCausalLM":
        fields.update(
            embedding_multiplier=float(d.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(d.get("residual_multiplier", 1.0)),
            attention_multiplier=float(d.get("attention_multiplier", 1.0)),
            logits_scaling=float(d.get("logits_scaling", 1.0)),
        )
    return fields


def _ernie_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    """Ernie 4.5 (dense): the Llama decoder with GLM's interleaved rotary over each whole head
    (computed in float32, as transformers does), biases on every projection or none (`use_bias`),
    tied embeddings by default."""
    d = {"head_dim": 128, "rms_norm_eps": 1e-5, **d}
    if d.get("use_bias"):
        raise ValueError(f"{arch} with use_bias=true is not supported")
    rope_theta, scaling, _ = rope_settings(d, 500000.0)
    check_silu(d, arch)
    fields = hf_decoder_fields(
        d, arch, rope_theta, scaling, None, [], attention_bias=False, qk_norm=False, tie_by_default=True
    )
    fields["rope_interleaved"] = True
    return fields


def _nope_layers(d: dict[str, Any]) -> tuple[int, ...]:
    """SmolLM3's layers without rotary: `no_rope_layers` holds 1 where a layer rotates, else
    every `no_rope_layer_interval`-th layer (4th by default) has none."""
    n = d["num_hidden_layers"]
    uses_rope = d.get("no_rope_layers")
    if uses_rope is None:
        interval = int(d.get("no_rope_layer_interval", 4))
        uses_rope = [int((i + 1) % interval != 0) for i in range(n)]
    if len(uses_rope) != n:
        raise ValueError(f"no_rope_layers has {len(uses_rope)} entries for {n} hidden layers")
    return tuple(i for i, rotates in enumerate(uses_rope) if not rotates)


def _attention_layers(d: dict[str, Any], arch: str) -> tuple[int | None, list[str]]:
    """(window, per-layer attention kinds) as transformers reads them: Mistral slides on every
    layer; Qwen2 / Qwen3 with `use_sliding_window` from layer `max_window_layers` on (an explicit
    `layer_types` list wins); Llama has no window (transformers ignores the key)."""
    if arch == "MistralForCausalLM":
        return every_layer_slides(d, arch)
    n = d["num_hidden_layers"]
    layer_types = list(d.get("layer_types") or [])
    if arch == "SmolLM3ForCausalLM":  # its window (where used) is on the layers without rotary
        window = d.get("sliding_window") if d.get("use_sliding_window") else None
        if not layer_types:
            nope = set(_nope_layers(d))
            layer_types = [SLIDING_ATTENTION if window is not None and i in nope else FULL_ATTENTION for i in range(n)]
        return window_if_sliding(window, layer_types)
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
    fields = join_fields(gguf_decoder_fields(meta, tensor_names, g_arch, arch), experts)
    p = g_arch + "."
    if g_arch == "ernie4_5":  # its interleaved rotary (llama.cpp's NORM mode, the rows as transformers has them)
        fields["rope_interleaved"] = True
    elif g_arch == "smollm3":  # llama.cpp's fixed step: no rotary on every 4th layer (no key says)
        fields["nope_layers"] = tuple(i for i in range(int(meta[p + "block_count"])) if (i + 1) % 4 == 0)
    elif g_arch == "granite":
        fields.update(gguf_granite_scales(meta, g_arch, fields["head_dim"]))
    return fields


FAMILY = ConfigFamily(
    architectures=(
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "SmolLM3ForCausalLM",
        "GraniteForCausalLM",
        "Ernie4_5ForCausalLM",
    ),
    hf_fields=hf_fields,
    model_types={
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "smollm3": "SmolLM3ForCausalLM",
        "granite": "GraniteForCausalLM",
        "ernie4_5": "Ernie4_5ForCausalLM",
    },
    gguf_architectures={
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "smollm3": "SmolLM3ForCausalLM",
        "granite": "GraniteForCausalLM",
        "ernie4_5": "Ernie4_5ForCausalLM",
    },
    gguf_fields=_gguf_fields,
)
