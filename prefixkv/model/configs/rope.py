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
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(rope_theta), scaling, local
