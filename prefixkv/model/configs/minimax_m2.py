"""MiniMax-M2 (transformers' MiniMaxM2ForCausalLM, model/minimax_m2.py): the Llama decoder with q and
k normed over their whole projections, rotary over the first `rotary_dim` of each head, and routed
experts in every layer, chosen by a sigmoid router with a selection bias. Its config.json reader,
with transformers' MiniMaxM2Config defaults; the multi-token-prediction modules after the last
layer (`num_mtp_modules`) are not the model's, and what the released configs could set otherwise
(linear attention layers, another scoring, a shared expert) is refused by name."""

from __future__ import annotations

from typing import Any

from .decoder import check_silu, hf_decoder_fields
from .family import ConfigFamily
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


FAMILY = ConfigFamily(
    architectures=("MiniMaxM2ForCausalLM",),
    hf_fields=_hf_fields,
    model_types={"minimax_m2": "MiniMaxM2ForCausalLM"},
)
