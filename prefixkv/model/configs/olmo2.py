"""OLMo 2 (model/olmo2.py: post-norm blocks, q/k normed over their whole projections): its
config.json reader, with transformers' Olmo2Config defaults."""

from __future__ import annotations

from typing import Any

from .decoder import check_silu, hf_decoder_fields
from .family import ConfigFamily
from .rope import rope_settings


def _hf_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    rope_theta, scaling, _ = rope_settings(d)
    check_silu(d, arch)
    if d.get("attention_bias"):
        raise ValueError(f"{arch} with attention_bias=true is not supported")
    d = {"rms_norm_eps": 1e-5, **d}
    # qk_norm False: its q/k norms span every head at once (model/olmo2.py), not Qwen 3's per head
    return hf_decoder_fields(d, arch, rope_theta, scaling, None, [], attention_bias=False, qk_norm=False)


FAMILY = ConfigFamily(
    architectures=("Olmo2ForCausalLM",),
    hf_fields=_hf_fields,
    model_types={"olmo2": "Olmo2ForCausalLM"},
)
