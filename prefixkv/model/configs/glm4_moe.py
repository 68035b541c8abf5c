"""GLM-4.5 to GLM-4.7 (transformers' Glm4MoeForCausalLM, model/glm4_moe.py): the Llama decoder with
rotary over half of each head (in halves, not GLM-4's pairs), q/k/v biases, q/k norms where
`use_qk_norm`, and from layer `first_k_dense_replace` on routed experts beside an ungated shared
one, chosen by a float32 sigmoid router with a selection bias and group-limited top k. Its
config.json reader, with transformers' Glm4MoeConfig defaults, and its GGUF reader (llama.cpp's
"glm4moe"); the multi-token-prediction layers after the last (`num_nextn_predict_layers`) are not
the model's."""

from __future__ import annotations

from typing import Any

from .common import join_fields
from .decoder import check_silu, gguf_decoder_fields, hf_decoder_fields
from .family import ConfigFamily
from .moe import GGUF_SIGMOID_GATING, gguf_moe_fields
from .rope import rope_settings


def routed_experts_fields(d: dict[str, Any], dense_layers: tuple[int, ...]) -> dict[str, Any]:
    """GLM-4.5's experts, which DeepSeek-V3 shares (configs/deepseek.py), from a config holding
    every key: `n_routed_experts` of `moe_intermediate_size`, top `num_experts_per_tok` by a float32
    sigmoid router with a selection bias among the `topk_group` best of `n_group` groups, the
    weights renormalised (+ 1e-20) and scaled, beside an ungated shared expert of
    `n_shared_experts` experts' width; the dense MLP in `dense_layers`."""
    width = int(d["moe_intermediate_size"])
    return dict(
        num_experts=int(d["n_routed_experts"]),
        num_experts_per_tok=int(d["num_experts_per_tok"]),
        moe_intermediate_size=width,
        mlp_only_layers=dense_layers,
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        router_scoring="sigmoid",
        router_selection_bias=True,
        router_num_groups=int(d.get("n_group") or 1),
        router_topk_groups=int(d.get("topk_group") or 1),
        router_logits_float32=True,
        router_scores_float32=True,
        router_norm_epsilon=1e-20,
        routed_scaling_factor=float(d["routed_scaling_factor"]),
        shared_expert_intermediate_size=width * int(d["n_shared_experts"] or 0),
        shared_expert_gated=False,
    )


def _hf_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    d = {  # transformers' Glm4MoeConfig defaults
        "rms_norm_eps": 1e-5, "intermediate_size": 10944, "n_routed_experts": d.get("num_local_experts") or 128,
        "moe_intermediate_size": 1408, "num_experts_per_tok": 8, "routed_scaling_factor": 1.0, "n_shared_experts": 1,
        **d,
    }  # fmt: skip
    rope_theta, scaling, _ = rope_settings(d)
    check_silu(d, arch)
    rope = d.get("rope_parameters") or {}
    fields = hf_decoder_fields(
        d,
        arch,
        rope_theta,
        scaling,
        None,
        [],
        attention_bias=bool(d.get("attention_bias", False)),
        qk_norm=bool(d.get("use_qk_norm", False)),
    )
    fields["partial_rotary_factor"] = float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.5)))
    dense = tuple(range(int(d.get("first_k_dense_replace", 1))))
    return join_fields(fields, routed_experts_fields(d, dense))


def _gguf_fields(meta: dict[str, Any], tensor_names: set[str], g_arch: str, arch: str) -> dict[str, Any]:
    """A GLM-4.5 GGUF file (convert_hf_to_gguf.py Glm4MoeModel): q/k rows as transformers has them,
    rotary over `rope.dimension_count` of each head, the sigmoid router's keys, the shared experts
    as `expert_shared_count` experts' width, the prediction layers counted in `block_count`."""
    p = g_arch + "."
    fields = gguf_decoder_fields(meta, tensor_names, g_arch, arch, partial_rotary=True)
    rope_dims = int(meta.get(p + "rope.dimension_count") or fields["head_dim"])
    fields["partial_rotary_factor"] = rope_dims / fields["head_dim"]
    return join_fields(fields, gguf_moe_fields(g_arch, meta, tensor_names, GGUF_SIGMOID_GATING))


FAMILY = ConfigFamily(
    architectures=("Glm4MoeForCausalLM",),
    hf_fields=_hf_fields,
    model_types={"glm4_moe": "Glm4MoeForCausalLM"},
    gguf_architectures={"glm4moe": "Glm4MoeForCausalLM"},
    gguf_fields=_gguf_fields,
)
