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
from .decoder import hf_decoder_fields, window_if_sliding
from .family import ConfigFamily

CAUSAL, CONDITIONAL = "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"
GEMMA4_ARCHITECTURES = (CAUSAL, CONDITIONAL)


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


FAMILY = ConfigFamily(
    architectures=GEMMA4_ARCHITECTURES,
    hf_fields=_hf_fields,
    model_types={"gemma4_text": CAUSAL, "gemma4": CONDITIONAL},
)
