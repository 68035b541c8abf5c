"""The attention decoder's fields that the Llama, Gemma and mixture-of-experts families read
alike, from config.json and from GGUF metadata."""

from __future__ import annotations

from typing import Any

from ..layer_kinds import FULL_ATTENTION, SLIDING_ATTENTION


def hf_decoder_fields(
    d: dict[str, Any],
    arch: str,
    rope_theta: float,
    scaling: dict[str, Any] | None,
    window: int | None,
    layer_types: list[str],
    attention_bias: bool,
    qk_norm: bool,
    tie_by_default: bool = False,
) -> dict[str, Any]:
    """The sizes, norms, rotary, tokens and attention layers of an HF config; what differs by
    family (rotary, windows, biases, q/k norms) the family's reader has read already."""
    n_heads = d["num_attention_heads"]
    return dict(
        architecture=arch,
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=n_heads,
        num_key_value_heads=d.get("num_key_value_heads") or n_heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // n_heads,
        intermediate_size=d["intermediate_size"],
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        rope_scaling=scaling,
        max_position_embeddings=d.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", tie_by_default)),
        attention_bias=attention_bias,
        qk_norm=qk_norm,
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id", []),  # an int or None too: __post_init__ makes it a list
        sliding_window=window,
        layer_types=layer_types,
    )


def check_silu(d: dict[str, Any], arch: str) -> None:
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{arch} with hidden_act={d.get('hidden_act')!r} is not supported (silu only)")


def every_layer_slides(d: dict[str, Any], arch: str) -> tuple[int | None, list[str]]:
    """(window, layer kinds) where every layer slides if `sliding_window` is set (Mistral, Mixtral);
    mixed `layer_types` are refused."""
    layer_types = list(d.get("layer_types") or [])
    window = d.get("sliding_window")
    if layer_types and set(layer_types) != {SLIDING_ATTENTION if window else FULL_ATTENTION}:
        raise ValueError(f"{arch} with mixed layer_types is not supported")
    return window, []


def window_if_sliding(window: int | None, layer_types: list[str]) -> tuple[int | None, list[str]]:
    """A window only where some layer slides."""
    return (window if SLIDING_ATTENTION in layer_types else None), layer_types


def gguf_decoder_fields(
    meta: dict[str, Any], tensor_names: set[str], g_arch: str, arch: str, partial_rotary: bool = False
) -> dict[str, Any]:
    """The sizes, norms, rotary and attention of a GGUF file's metadata, as llama.cpp reads them;
    a value head size other than the key's is refused, and so is partial rotary unless the family
    reads it (`partial_rotary`)."""
    p = g_arch + "."
    hidden = int(meta[p + "embedding_length"])
    n_heads = int(meta[p + "attention.head_count"])
    n_kv = int(meta.get(p + "attention.head_count_kv", n_heads))
    head_dim = int(meta.get(p + "attention.key_length", hidden // n_heads))
    value_length = int(meta.get(p + "attention.value_length", head_dim))
    if value_length != head_dim:
        raise ValueError(
            f"GGUF {p}attention.value_length ({value_length}) != {p}attention.key_length ({head_dim}) is not supported"
        )
    rope_dims = meta.get(p + "rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim and not partial_rotary:
        raise ValueError(
            f"GGUF {p}rope.dimension_count ({rope_dims}) != the head dimension ({head_dim}): partial "
            "rotary embeddings are not supported"
        )
    scaling = gguf_rope_scaling(meta, p)
    return dict(
        architecture=arch,
        hidden_size=hidden,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        intermediate_size=int(meta[p + "feed_forward_length"]),
        rms_norm_eps=float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta.get(p + "rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(meta.get(p + "context_length", 2048)),
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        attention_output_bias="blk.0.attn_output.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
    )


def gguf_rope_scaling(meta: dict[str, Any], p: str) -> dict[str, Any] | None:
    """The rotary scaling of a GGUF file's metadata in transformers' terms: linear, or YaRN with
    its factor, original context and betas (llama.cpp rounds YaRN's correction range outward, as
    transformers' default `truncate` does). YaRN's attention factor and log multiplier are refused
    (llama.cpp multiplies its own mscale by them, where transformers' `attention_factor` replaces
    it, so no reading of them is safe), and so is an extrapolation factor other than 1."""
    stype = meta.get(p + "rope.scaling.type")
    if stype in (None, "none"):
        return None
    if stype == "linear":
        return {"rope_type": "linear", "factor": float(meta[p + "rope.scaling.factor"])}
    if stype != "yarn":
        raise ValueError(f"Unsupported GGUF rope scaling type {stype!r}")
    for key in ("rope.scaling.attn_factor", "rope.scaling.yarn_attn_factor", "rope.scaling.yarn_log_multiplier"):
        if meta.get(p + key) is not None:
            raise ValueError(f"GGUF {p}{key} (YaRN's attention scale) is not supported")
    ext = meta.get(p + "rope.scaling.yarn_ext_factor")
    if ext is not None and float(ext) != 1.0:
        raise ValueError(f"GGUF {p}rope.scaling.yarn_ext_factor={ext} is not supported (1.0 only)")
    for key in ("rope.scaling.factor", "rope.scaling.original_context_length"):
        if meta.get(p + key) is None:
            raise ValueError(f"GGUF YaRN scaling without {p}{key}")
    scaling: dict[str, Any] = {
        "rope_type": "yarn",
        "factor": float(meta[p + "rope.scaling.factor"]),
        "original_max_position_embeddings": int(meta[p + "rope.scaling.original_context_length"]),
    }
    for key, name in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
        if meta.get(p + key) is not None:
            scaling[name] = float(meta[p + key])
    return scaling


def gguf_layers_with_attention(meta: dict[str, Any], g_arch: str) -> tuple[dict[str, Any], list[bool]]:
    """A hybrid's GGUF metadata with its per-layer `attention.head_count_kv` (0 on a layer without
    attention: LFM2's convolutions, Granite 4's mixers) as the one count of its attention layers,
    and which layers have attention; ValueError for counts that differ between layers."""
    p = g_arch + "."
    n = int(meta[p + "block_count"])
    per_layer = meta.get(p + "attention.head_count_kv")
    kv = list(per_layer) if isinstance(per_layer, (list, tuple)) else [per_layer] * n
    counts = {int(k) for k in kv if k}
    if len(kv) != n or len(counts) > 1:
        raise ValueError(f"GGUF {p}attention.head_count_kv={per_layer!r}: expected a count per layer, one nonzero")
    return {**meta, p + "attention.head_count_kv": counts.pop() if counts else 1}, [bool(k) for k in kv]


def gguf_granite_scales(meta: dict[str, Any], g_arch: str, head_dim: int) -> dict[str, float]:
    """Granite's four multipliers from a GGUF file's scales (Granite 3 and 4), llama.cpp's defaults
    where a key is missing (the attention's: 1 / sqrt(head))."""
    p = g_arch + "."
    return dict(
        embedding_multiplier=float(meta.get(p + "embedding_scale") or 1.0),
        residual_multiplier=float(meta.get(p + "residual_scale") or 1.0),
        attention_multiplier=float(meta.get(p + "attention.scale") or head_dim**-0.5),
        logits_scaling=float(meta.get(p + "logit_scale") or 1.0),
    )
