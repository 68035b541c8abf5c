"""OLMo 2 and OLMo 3 (model/olmo2.py: post-norm blocks, q/k normed over their whole projections;
OLMo 3's sliding and full layers, the full ones' rotary scaled): their config.json reader, with
transformers' Olmo2Config / Olmo3Config defaults, and OLMo 2's GGUF reader (llama.cpp's "olmo2")."""

from __future__ import annotations

from typing import Any

from ..layer_kinds import FULL_ATTENTION, SLIDING_ATTENTION
from .decoder import check_silu, gguf_decoder_fields, hf_decoder_fields, window_if_sliding
from .family import ConfigFamily
from .rope import rope_settings


def _hf_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    olmo3 = arch == "Olmo3ForCausalLM"
    rope_theta, scaling, local = rope_settings(d, 500000.0 if olmo3 else 10000.0)
    check_silu(d, arch)
    if d.get("attention_bias"):
        raise ValueError(f"{arch} with attention_bias=true is not supported")
    d = {"rms_norm_eps": 1e-5, **d}
    window, layer_types, local_theta = None, [], None
    if olmo3:  # three sliding layers to one full by default; the sliding ones' rotary unscaled
        n = d["num_hidden_layers"]
        layer_types = list(d.get("layer_types") or [])
        if not layer_types:
            layer_types = [SLIDING_ATTENTION if (i + 1) % 4 else FULL_ATTENTION for i in range(n)]
        window, layer_types = window_if_sliding(d.get("sliding_window", 4096), layer_types)
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"{arch}'s sliding layers with rope type {local['rope_type']!r} are not supported")
        local_theta = float(local.get("rope_theta", rope_theta))
    # qk_norm False: its q/k norms span every head at once (model/olmo2.py), not Qwen 3's per head
    fields = hf_decoder_fields(d, arch, rope_theta, scaling, window, layer_types, attention_bias=False, qk_norm=False)
    if window is not None and (scaling is not None or local_theta != rope_theta):
        fields["rope_local_theta"] = local_theta
    return fields


def _gguf_fields(meta: dict[str, Any], tensor_names: set[str], g_arch: str, arch: str) -> dict[str, Any]:
    """An OLMo 2 GGUF file (convert_hf_to_gguf.py Olmo2Model). OLMo 3 is written under the same
    name with a window and its pattern, and its full layers' YaRN with an attention factor; such a
    file is refused by name."""
    p = g_arch + "."
    for key in ("attention.sliding_window", "attention.sliding_window_pattern"):
        if meta.get(p + key):
            raise ValueError(f"GGUF {p}{key} (OLMo 3's sliding layers) is not supported; OLMo 3 runs from an HF folder")
    if "blk.0.attn_q.bias" in tensor_names:
        raise ValueError("GGUF olmo2 with attention biases is not supported")
    fields = gguf_decoder_fields(meta, tensor_names, g_arch, arch)
    fields["qk_norm"] = False  # its q/k norms span every head at once (model/olmo2.py)
    return fields


FAMILY = ConfigFamily(
    architectures=("Olmo2ForCausalLM", "Olmo3ForCausalLM"),
    hf_fields=_hf_fields,
    model_types={"olmo2": "Olmo2ForCausalLM", "olmo3": "Olmo3ForCausalLM"},
    gguf_architectures={"olmo2": "Olmo2ForCausalLM"},
    gguf_fields=_gguf_fields,
)
