"""gpt-oss (model/gpt_oss.py: sinks, biased projections, clamped-SwiGLU experts): its config.json
reader, with transformers' GptOssConfig defaults, and its GGUF reader (llama.cpp's "gpt-oss")."""

from __future__ import annotations

from typing import Any

from ..layer_kinds import FULL_ATTENTION, SLIDING_ATTENTION
from .decoder import check_silu, gguf_decoder_fields, hf_decoder_fields, window_if_sliding
from .family import ConfigFamily
from .rope import rope_settings

# GptOssConfig's rotary where config.json names none
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def _hf_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    d = dict(d)
    for key, default in (("head_dim", 64), ("num_local_experts", 128), ("num_experts_per_tok", 4)):
        d.setdefault(key, default)
    if d.get("rope_scaling") is None and not d.get("rope_parameters"):
        d["rope_scaling"] = dict(DEFAULT_ROPE)
    rope_theta, scaling, _ = rope_settings(d, default_theta=150000.0)
    check_silu(d, arch)
    n = d["num_hidden_layers"]
    layer_types = list(d.get("layer_types") or [])
    if not layer_types:
        layer_types = _even_layers_slide(n)
    window, layer_types = window_if_sliding(d.get("sliding_window", 128), layer_types)
    fields = hf_decoder_fields(
        d, arch, rope_theta, scaling, window, layer_types, bool(d.get("attention_bias", True)), qk_norm=False
    )
    fields["rms_norm_eps"] = float(d.get("rms_norm_eps", 1e-5))
    fields["max_position_embeddings"] = int(d.get("max_position_embeddings", 131072))
    fields.update(
        attention_output_bias=fields["attention_bias"],
        attention_sinks=True,
        num_experts=int(d["num_local_experts"]),
        num_experts_per_tok=int(d["num_experts_per_tok"]),
        moe_intermediate_size=int(d["intermediate_size"]),
        swiglu_limit=float(d.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(d.get("swiglu_alpha", 1.702)),
    )
    return fields


def _even_layers_slide(n: int) -> list[str]:
    return [SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(n)]


def _gguf_fields(meta: dict[str, Any], tensor_names: set[str], g_arch: str, arch: str) -> dict[str, Any]:
    """A gpt-oss GGUF file as llama.cpp's converter writes it (GptOssModel) and llama.cpp reads it:
    the even layers slide, the experts' clamped SwiGLU has gpt-oss's fixed limit and alpha, the
    router's top-k logits are softmaxed. YaRN keeps OpenAI's unrounded correction range
    (`truncate` false, as the released config.json says and vLLM and SGLang do); llama.cpp rounds
    it, which moves a few rotary frequencies slightly."""
    p = g_arch + "."
    fields = gguf_decoder_fields(meta, tensor_names, g_arch, arch)
    if fields["rope_scaling"] is not None and fields["rope_scaling"]["rope_type"] == "yarn":
        fields["rope_scaling"]["truncate"] = False
    missing = [t for t in ("blk.0.attn_sinks.weight", "blk.0.ffn_gate_inp.weight") if t not in tensor_names]
    if missing:
        raise ValueError(f"GGUF gpt-oss file without {', '.join(missing)}: not a gpt-oss checkpoint")
    if not meta.get(p + "expert_count") or not meta.get(p + "expert_used_count"):
        raise ValueError(f"GGUF gpt-oss file without {p}expert_count / {p}expert_used_count")
    window = meta.get(p + "attention.sliding_window")
    window, layer_types = window_if_sliding(
        int(window) if window else None, _even_layers_slide(int(meta[p + "block_count"]))
    )
    fields.update(
        sliding_window=window,
        layer_types=layer_types if window else [],
        attention_output_bias=fields["attention_bias"],
        attention_sinks=True,
        num_experts=int(meta[p + "expert_count"]),
        num_experts_per_tok=int(meta[p + "expert_used_count"]),
        moe_intermediate_size=int(meta.get(p + "expert_feed_forward_length") or meta[p + "feed_forward_length"]),
        swiglu_limit=7.0,
        swiglu_alpha=1.702,
    )
    return fields


FAMILY = ConfigFamily(
    architectures=("GptOssForCausalLM",),
    hf_fields=_hf_fields,
    model_types={"gpt_oss": "GptOssForCausalLM"},
    quantizations=("mxfp4",),
    gguf_architectures={"gpt-oss": "GptOssForCausalLM"},
    gguf_fields=_gguf_fields,
)
