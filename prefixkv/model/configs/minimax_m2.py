"""MiniMax-M2 (transformers' MiniMaxM2ForCausalLM, model/minimax_m2.py): the Llama decoder with q and
k normed over their whole projections, rotary over the first `rotary_dim` of each head, and routed
experts in every layer, chosen by a sigmoid router with a selection bias. Its config.json reader,
with transformers' MiniMaxM2Config defaults, and its GGUF reader (llama.cpp's "minimax-m2"); the
multi-token-prediction modules after the last layer (`num_mtp_modules`) are not the model's, and
what the released configs could set otherwise (linear attention layers, another scoring, a shared
expert) is refused by name."""

from __future__ import annotations

from typing import Any

from .common import join_fields
from .decoder import check_silu, gguf_decoder_fields, hf_decoder_fields
from .family import ConfigFamily
from .moe import GGUF_SIGMOID_GATING, gguf_moe_fields
from .rope import rope_settings


def _refuse_other_settings(d: dict[str, Any], arch: str) -> None:
    checks = [
        ("scoring_func", d.get("scoring_func", "sigmoid") == "sigmoid"),
        ("use_routing_bias", d.get("use_routing_bias", True) is True),
        ("use_qk_norm", d.get("use_qk_norm", True) is True),
        ("qk_norm_type", d.get("qk_norm_type", "per_layer") == "per_layer"),
        ("shared_intermediate_size", not d.get("shared_intermediate_size")),
        ("attn_type_list", all(int(t) == 1 for t in d.get("attn_type_list") or ())),
        ("sliding_window", d.get("sliding_window") is None),
    ]
    for name, as_built in checks:
        if not as_built:
            raise ValueError(f"{arch} with {name}={d.get(name)!r} is not supported (the released settings only)")


def _hf_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    d = {"head_dim": 128, "intermediate_size": 1536, "rms_norm_eps": 1e-6, "rope_theta": 5000000.0, **d}
    _refuse_other_settings(d, arch)
    check_silu(d, arch)
    rope_theta, scaling, _ = rope_settings(d)
    # qk_norm False: its q/k norms span every head at once (model/minimax_m2.py), not Qwen 3's per head
    fields = hf_decoder_fields(d, arch, rope_theta, scaling, None, [], attention_bias=False, qk_norm=False)
    rope = d.get("rope_parameters") or {}
    rotary = d.get("rotary_dim")
    partial = rotary / fields["head_dim"] if rotary is not None else rope.get("partial_rotary_factor", 1.0)
    fields.update(
        partial_rotary_factor=float(partial),
        num_experts=int(d.get("num_local_experts", 256)),
        num_experts_per_tok=int(d.get("num_experts_per_tok", 8)),
        moe_intermediate_size=fields["intermediate_size"],
        norm_topk_prob=True,
        router_scoring="sigmoid",
        router_selection_bias=True,
        router_scores_float32=True,
    )
    return fields


def _gguf_fields(meta: dict[str, Any], tensor_names: set[str], g_arch: str, arch: str) -> dict[str, Any]:
    """A MiniMax-M2 GGUF file (convert_hf_to_gguf.py MiniMaxM2Model): rotary over
    `rope.dimension_count` of each head, q/k norms over the whole projection (their tensors'
    widths), a sigmoid router unless the file says otherwise (llama.cpp's own default for it)."""
    p = g_arch + "."
    fields = gguf_decoder_fields(meta, tensor_names, g_arch, arch, partial_rotary=True)
    rope_dims = int(meta.get(p + "rope.dimension_count") or fields["head_dim"])
    fields.update(partial_rotary_factor=rope_dims / fields["head_dim"], qk_norm=False)
    experts = gguf_moe_fields(g_arch, meta, tensor_names, GGUF_SIGMOID_GATING)
    experts.update(router_logits_float32=False)  # transformers' router: logits in the model's dtype
    return join_fields(fields, experts)


FAMILY = ConfigFamily(
    architectures=("MiniMaxM2ForCausalLM",),
    hf_fields=_hf_fields,
    model_types={"minimax_m2": "MiniMaxM2ForCausalLM"},
    gguf_architectures={"minimax-m2": "MiniMaxM2ForCausalLM"},
    gguf_fields=_gguf_fields,
)
