"""Rotary settings from an HF config, where transformers >= 5 keeps them in `rope_parameters`
(per layer type for Gemma 3) and older configs at the top level (`rope_theta`, `rope_scaling`)."""

from __future__ import annotations

from typing import Any

from ..layer_kinds import FULL_ATTENTION, SLIDING_ATTENTION


def rope_settings(
    d: dict[str, Any], default_theta: float = 10000.0
) -> tuple[float, dict[str, Any] | None, dict[str, Any]]:
    """(rotary base, scaling or None, the sliding layers' own `rope_parameters` where they are
    given per layer type, else {}); a scaling of type "default" is None."""
    rope_params = d.get("rope_parameters") or {}
    local: dict[str, Any] = {}
    if FULL_ATTENTION in rope_params or SLIDING_ATTENTION in rope_params:
        local = rope_params.get(SLIDING_ATTENTION) or {}
        rope_params = rope_params.get(FULL_ATTENTION) or {}
    rope_theta = rope_params.get("rope_theta", d.get("rope_theta", default_theta))
    scaling = d.get("rope_scaling")
    if scaling is None and rope_params:
        scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        scaling = None
    elif kind in ("yarn", "llama3", "longrope") and scaling is not None:
        scaling = _with_original_context(scaling, d)
    return float(rope_theta), scaling, local


def _with_original_context(scaling: dict[str, Any], d: dict[str, Any]) -> dict[str, Any]:
    """A scaling with `original_max_position_embeddings` where transformers supplies it (the
    config's top-level field, else max_position_embeddings), and YaRN's or LongRoPE's `factor`,
    where it is null, as the ratio of the two context lengths (DeepSeek-V3's and Phi-3's configs)."""
    scaling = dict(scaling)
    key = "original_max_position_embeddings"
    if d.get(key) is not None:  # the top-level field wins (Phi-3 keeps its value there)
        scaling[key] = d[key]
    elif scaling.get(key) is None and d.get("max_position_embeddings") is not None:
        scaling[key] = d["max_position_embeddings"]
    if scaling.get("factor") is None and scaling.get(key) and d.get("max_position_embeddings") is not None:
        scaling["factor"] = d["max_position_embeddings"] / scaling[key]
    return scaling
