"""Gemma 4 (text; model/gemma4.py): its config.json reader, for Gemma4ForCausalLM and for
Gemma4ForConditionalGeneration served text-only (its `text_config`).

The full-attention layers' head size and K/V heads come from `per_layer_config` (transformers 5's
saved form: layer index -> overrides) or from `global_head_dim` / `num_global_key_value_heads`
(the released configs' form; the K/V heads apply only with `attention_k_eq_v`, as transformers
reads them). Their rotary is `rope_parameters["full_attention"]` (proportional), the sliding
layers' the plain one on their own base."""

from __future__ import annotations

from typing import Any

from ..layer_kinds import FULL_ATTENTION, SLIDING_ATTENTION
from .common import join_fields
from .decoder import gguf_rope_scaling, hf_decoder_fields, window_if_sliding
from .family import ConfigFamily

CAUSAL, CONDITIONAL = "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"
GEMMA4_ARCHITECTURES = (CAUSAL, CONDITIONAL)
# what the loader reads from a gemma4 GGUF's tensors into its metadata (loader.gguf_config): the
# values of `rope_freqs` (1 for each rotating frequency of the full layers, 1e30 for the others)
# and the rows of the per-layer embedding (not trimmed to the vocabulary, as the embedding is)
GGUF_ROPE_FREQS = "rope_freqs"
GGUF_PER_LAYER_ROWS = "per_layer_token_embd.rows"


def _hf_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    text = dict(d.get("text_config") or {}) if arch == CONDITIONAL else d
    if arch == CONDITIONAL and "tie_word_embeddings" in d:  # the outer one wins, as in transformers
        text["tie_word_embeddings"] = d["tie_word_embeddings"]
    _refuse_unbuilt(text, arch)
    n = text["num_hidden_layers"]
    layer_types = list(text.get("layer_types") or [])
    layer_types = layer_types or [SLIDING_ATTENTION if (i + 1) % 6 else FULL_ATTENTION for i in range(n)]
    layer_types[-1] = FULL_ATTENTION  # transformers forces the last layer to full attention
    window, layer_types = window_if_sliding(text.get("sliding_window", 512), layer_types)
    rope = text.get("rope_parameters") or {}
    full = rope.get(FULL_ATTENTION) or {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    local = rope.get(SLIDING_ATTENTION) or {}
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"{arch}'s sliding layers with rope type {local['rope_type']!r} are not supported")
    kind = full.get("rope_type", "default")
    if kind not in ("default", "proportional"):
        raise ValueError(f"{arch}'s full layers with rope type {kind!r} are not supported (default, proportional)")
    scaling = None if kind == "default" else {k: v for k, v in full.items() if k != "rope_theta"}
    head_dim = text.get("head_dim", 256)
    global_head_dim, global_kv_heads = _full_layer_shape(text, layer_types, head_dim)
    fields = hf_decoder_fields(
        dict(text, head_dim=head_dim),
        arch,
        float(full.get("rope_theta", 1_000_000.0)),
        scaling,
        window,
        layer_types,
        False,
        qk_norm=True,
        tie_by_default=True,
    )
    per_layer = text.get("hidden_size_per_layer_input", 256) or 0
    gemma4 = dict(
        query_pre_attn_scalar=1.0,  # q and k are normed: transformers scales scores by 1
        final_logit_softcapping=text.get("final_logit_softcapping"),
        rope_local_theta=float(local.get("rope_theta", 10000.0)),
        hidden_activation=text.get("hidden_activation") or "gelu_pytorch_tanh",
        global_head_dim=global_head_dim,
        global_num_key_value_heads=global_kv_heads,
        global_values_are_keys=bool(text.get("attention_k_eq_v", False)),
        num_kv_shared_layers=int(text.get("num_kv_shared_layers", 0) or 0),
        double_wide_shared_mlp=bool(text.get("use_double_wide_mlp", False)),
        per_layer_input_size=int(per_layer),
        per_layer_input_vocab_size=int(text.get("vocab_size_per_layer_input", 262_144)) if per_layer else 0,
    )
    if text.get("enable_moe_block"):  # routed experts beside every layer's dense MLP (model/gemma4.py)
        gemma4.update(
            num_experts=int(text["num_experts"]),
            num_experts_per_tok=int(text["top_k_experts"]),
            moe_intermediate_size=int(text["moe_intermediate_size"]),
            norm_topk_prob=True,
        )
    return join_fields(fields, gemma4)


def _refuse_unbuilt(text: dict[str, Any], arch: str) -> None:
    if text.get("attention_bias"):
        raise ValueError(f"{arch} with attention_bias=true is not supported")
    if text.get("use_bidirectional_attention") == "all":
        raise ValueError(f"{arch} with use_bidirectional_attention='all' (an embedding model) is not supported")


def _full_layer_shape(text: dict[str, Any], layer_types: list[str], head_dim: int) -> tuple[int, int]:
    """(head size, K/V heads) of the full-attention layers; every other layer has the config's."""
    kv_heads = text.get("num_key_value_heads") or text["num_attention_heads"]
    overrides = text.get("per_layer_config")
    if overrides is None:
        global_kv = text.get("num_global_key_value_heads") if text.get("attention_k_eq_v", False) else None
        return int(text.get("global_head_dim", 512)), int(global_kv or kv_heads)
    try:  # keyed by layer index, as text ("5", or "05" in a model of ten layers or more)
        by_layer = {int(k): v for k, v in overrides.items()}
    except ValueError:
        raise ValueError(f"per_layer_config keys {sorted(overrides)} are not layer indices") from None
    shapes: dict[str, set[tuple[int, int]]] = {FULL_ATTENTION: set(), SLIDING_ATTENTION: set()}
    allowed = {"head_dim", "num_key_value_heads"}
    for i, kind in enumerate(layer_types):
        override = by_layer.get(i) or {}
        if set(override) - allowed:
            unknown = sorted(set(override) - allowed)
            raise ValueError(f"per_layer_config overrides {unknown} of layer {i}: not supported")
        shapes[kind].add((int(override.get("head_dim", head_dim)), int(override.get("num_key_value_heads", kv_heads))))
    if len(shapes[FULL_ATTENTION]) > 1 or shapes[SLIDING_ATTENTION] - {(head_dim, kv_heads)}:
        raise ValueError(
            "per_layer_config gives layers of one kind different attention shapes: supported are one shape for the "
            "full-attention layers and the config's own for the sliding ones"
        )
    return shapes[FULL_ATTENTION].pop() if shapes[FULL_ATTENTION] else (head_dim, kv_heads)


def _gguf_fields(meta: dict[str, Any], tensor_names: set[str], g_arch: str, arch: str) -> dict[str, Any]:
    """A `gemma4` GGUF's fields, as llama.cpp reads them (src/llama-model.cpp): the full layers'
    head size in `attention.key_length`, the sliding ones' in `key_length_swa`; K/V heads and MLP
    widths a scalar or one per layer (the KV-shared layers' twice as wide: double-wide MLPs);
    `attention.sliding_window_pattern` (true: sliding) required; the KV-shared layers counted in
    `attention.shared_kv_layers`; values that are keys where a full layer has no `attn_v`; the
    proportional rotary's share from `rope_freqs`; the logits capped at 30 where the file says
    nothing (llama.cpp's default)."""
    p = g_arch + "."
    n = int(meta[p + "block_count"])
    shared = int(meta.get(p + "attention.shared_kv_layers") or 0)
    pattern = meta.get(p + "attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != n:
        raise ValueError(f"GGUF {p}attention.sliding_window_pattern must list one boolean per layer ({n})")
    layer_types = [SLIDING_ATTENTION if bool(s) else FULL_ATTENTION for s in pattern]
    head_dim, global_head_dim = int(meta[p + "attention.key_length_swa"]), int(meta[p + "attention.key_length"])
    for key, want in (("value_length_swa", head_dim), ("value_length", global_head_dim)):
        if int(meta.get(p + "attention." + key, want)) != want:
            raise ValueError(f"GGUF {p}attention.{key} other than the key length is not supported")
    for key, want in (("rope.dimension_count_swa", head_dim), ("rope.dimension_count", global_head_dim)):
        if int(meta.get(p + key, want)) != want:
            raise ValueError(f"GGUF {p}{key} other than the head size is not supported")
    if gguf_rope_scaling(meta, p) is not None:
        raise ValueError(f"GGUF {p}rope.scaling.type is not supported for Gemma 4")
    heads = int(meta[p + "attention.head_count"])
    kv = _per_kind(meta.get(p + "attention.head_count_kv", heads), layer_types, f"{p}attention.head_count_kv")
    ff = meta[p + "feed_forward_length"]
    widths = [int(x) for x in ff] if isinstance(ff, list) else [int(ff)] * n
    base = widths[0]
    double = shared > 0 and widths[n - shared :] == [2 * base] * shared
    if widths[: n - shared] != [base] * (n - shared) or not (double or widths[n - shared :] == [base] * shared):
        raise ValueError(f"GGUF {p}feed_forward_length {widths}: one width, or twice it on the KV-shared layers")
    first_full = layer_types.index(FULL_ATTENTION) if FULL_ATTENTION in layer_types else None
    freqs = meta.get(f"{p}{GGUF_ROPE_FREQS}")
    scaling = None if freqs is None else _proportional(freqs, global_head_dim, f"{p}{GGUF_ROPE_FREQS}")
    per_layer = int(meta.get(p + "embedding_length_per_layer_input") or 0)
    cap = meta.get(p + "final_logit_softcapping")
    fields: dict[str, Any] = dict(
        architecture=arch,
        hidden_size=int(meta[p + "embedding_length"]),
        num_attention_heads=heads,
        num_key_value_heads=kv[SLIDING_ATTENTION] or kv[FULL_ATTENTION],
        head_dim=head_dim,
        intermediate_size=base,
        rms_norm_eps=float(meta[p + "attention.layer_norm_rms_epsilon"]),
        rope_theta=float(meta.get(p + "rope.freq_base", 1_000_000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(meta.get(p + "context_length", 131_072)),
        qk_norm=True,
        sliding_window=int(meta[p + "attention.sliding_window"]) if SLIDING_ATTENTION in layer_types else None,
        layer_types=layer_types,
        query_pre_attn_scalar=1.0,
        final_logit_softcapping=30.0 if cap is None else float(cap) or None,
        rope_local_theta=float(meta.get(p + "rope.freq_base_swa", 10000.0)),
        hidden_activation="gelu_pytorch_tanh",
        global_head_dim=global_head_dim,
        global_num_key_value_heads=kv[FULL_ATTENTION] or kv[SLIDING_ATTENTION],
        global_values_are_keys=first_full is not None and f"blk.{first_full}.attn_v.weight" not in tensor_names,
        num_kv_shared_layers=shared,
        double_wide_shared_mlp=double,
        per_layer_input_size=per_layer,
        per_layer_input_vocab_size=int(meta.get(f"{p}{GGUF_PER_LAYER_ROWS}", 0)) if per_layer else 0,
    )
    if "blk.0.ffn_gate_inp.weight" in tensor_names:  # llama.cpp: a layer with a router is a MoE one
        fields.update(
            num_experts=int(meta[p + "expert_count"]),
            num_experts_per_tok=int(meta[p + "expert_used_count"]),
            moe_intermediate_size=int(meta[p + "expert_feed_forward_length"]),
            norm_topk_prob=True,
        )
    return fields


def _per_kind(value: Any, layer_types: list[str], key: str) -> dict[str, int]:
    """A per-layer GGUF value (a scalar, or one per layer) as one value per kind of layer."""
    values = [int(x) for x in value] if isinstance(value, list) else [int(value)] * len(layer_types)
    if len(values) != len(layer_types):
        raise ValueError(f"GGUF {key} has {len(values)} entries for {len(layer_types)} layers")
    kinds: dict[str, int] = {FULL_ATTENTION: 0, SLIDING_ATTENTION: 0}
    for kind, v in zip(layer_types, values):
        if kinds[kind] not in (0, v):
            raise ValueError(f"GGUF {key} {values}: one value per kind of layer is supported")
        kinds[kind] = v
    return kinds


def _proportional(freqs: list[float], head_dim: int, key: str) -> dict[str, Any]:
    """The proportional rotary whose frequency divisors llama.cpp keeps in `rope_freqs`: 1 for
    each of the first angles, 1e30 (a zero frequency) for the rest."""
    rotating = sum(1 for f in freqs if f == 1.0)
    if len(freqs) != head_dim // 2 or any(f < 1e29 for f in freqs[rotating:]):
        raise ValueError(f"GGUF {key}: {head_dim // 2} divisors, 1 then 1e30, are supported")
    return {"rope_type": "proportional", "partial_rotary_factor": 2 * rotating / head_dim}


FAMILY = ConfigFamily(
    architectures=GEMMA4_ARCHITECTURES,
    hf_fields=_hf_fields,
    model_types={"gemma4_text": CAUSAL, "gemma4": CONDITIONAL},
    gguf_architectures={"gemma4": CAUSAL},
    gguf_fields=_gguf_fields,
)
