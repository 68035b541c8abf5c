"""DeepSeek-V3 / R1 / V3.1 and Kimi K2 (transformers' DeepseekV3ForCausalLM) and GLM-4.7-Flash
(Glm4MoeLiteForCausalLM): multi-head latent attention (model/deepseek.py) and GLM-4.5's experts -
a float32 sigmoid router with a selection bias and group-limited top k, an ungated shared expert -
after the first dense layers. Their config.json reader, with transformers' defaults; the
multi-token-prediction layers after the last are not the model's, and DeepSeek-V2's routing
(softmax scores, `topk_method` greedy) is refused by name. Their GGUF files (llama.cpp's
"deepseek2", which GLM-4.7-Flash's converter writes too) have a reader of their own here."""

from __future__ import annotations

from typing import Any

from .common import join_fields
from .decoder import check_silu, gguf_decoder_fields, hf_decoder_fields
from .family import ConfigFamily
from .glm4_moe import routed_experts_fields
from .moe import gguf_moe_fields
from .rope import rope_settings

_V3_DEFAULTS: dict[str, Any] = {
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "rms_norm_eps": 1e-6, "rope_interleave": True,
}  # fmt: skip
_GLM_LITE_DEFAULTS: dict[str, Any] = {
    "intermediate_size": 10240, "moe_intermediate_size": 1536, "n_shared_experts": 1, "n_routed_experts": 64,
    "routed_scaling_factor": 1.8, "kv_lora_rank": 512, "q_lora_rank": 768, "qk_rope_head_dim": 64, "v_head_dim": 256,
    "qk_nope_head_dim": 192, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 4, "rms_norm_eps": 1e-5,
    "rope_interleave": True,
}  # fmt: skip


def _dense_layers(d: dict[str, Any], arch: str) -> tuple[int, ...]:
    """The layers with the dense MLP: GLM-4.7-Flash's `mlp_layer_types` ("dense" / "sparse"), else
    the first `first_k_dense_replace` (every layer after them sparse: `moe_layer_freq` 1)."""
    n = int(d["num_hidden_layers"])
    kinds = d.get("mlp_layer_types")
    if kinds:
        if len(kinds) != n or set(kinds) - {"dense", "sparse"}:
            raise ValueError(f"{arch} mlp_layer_types must name dense or sparse for each of {n} layers, got {kinds}")
        return tuple(i for i, kind in enumerate(kinds) if kind == "dense")
    if int(d.get("moe_layer_freq", 1)) != 1:
        raise ValueError(
            f"{arch} with moe_layer_freq={d['moe_layer_freq']!r} is not supported (1: every layer after the dense ones)"
        )
    return tuple(range(min(n, int(d.get("first_k_dense_replace", 1)))))


def _hf_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    defaults = _GLM_LITE_DEFAULTS if arch == "Glm4MoeLiteForCausalLM" else _V3_DEFAULTS
    d = {**defaults, **d}  # (a null q_lora_rank: no query rank)
    for name, built in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if d.get(name, built) != built:
            raise ValueError(f"{arch} with {name}={d[name]!r} is not supported ({built} only: DeepSeek-V3's routing)")
    check_silu(d, arch)
    rope_theta, scaling, _ = rope_settings(d)
    rank, rope = int(d["kv_lora_rank"]), int(d["qk_rope_head_dim"])
    # the cache's one head: the latent and the rotary key (model/deepseek.py)
    latent = {**d, "head_dim": rank + rope, "num_key_value_heads": 1}
    fields = hf_decoder_fields(
        latent, arch, rope_theta, scaling, None, [], attention_bias=bool(d.get("attention_bias", False)), qk_norm=False
    )
    fields.update(
        rope_interleaved=bool(d["rope_interleave"]),
        mla_kv_lora_rank=rank,
        mla_q_lora_rank=int(d.get("q_lora_rank") or 0),
        mla_qk_nope_head_dim=int(d["qk_nope_head_dim"]),
        mla_qk_rope_head_dim=rope,
        mla_v_head_dim=int(d["v_head_dim"]),
    )
    return join_fields(fields, routed_experts_fields(d, _dense_layers(d, arch)))


def _gguf_fields(meta: dict[str, Any], tensor_names: set[str], g_arch: str, arch: str) -> dict[str, Any]:
    """A DeepSeek-V3 or GLM-4.7-Flash GGUF file (convert_hf_to_gguf.py DeepseekV2Model): one K/V
    head of `key_length` = kv_lora_rank + the rotary dimensions (`value_length` = kv_lora_rank),
    the per-head sizes in `key_length_mla` / `value_length_mla` (a file from before them: in
    `key_length` / `value_length`), the query's rank where there is one, the rotary interleaved
    (llama.cpp rotates deepseek2 in pairs; the converter keeps the rows as they are), YaRN's
    softmax-scale correction as `yarn_log_multiplier` = 0.1 mscale_all_dim (its mscale taken
    equal, as in DeepSeek's releases), the experts by gguf_moe_fields: DeepSeek-V2's softmax
    routing (no `expert_gating_func`, llama.cpp's default for it) is refused by name."""
    p = g_arch + "."
    rank = int(meta[p + "attention.kv_lora_rank"])
    rope = int(meta[p + "rope.dimension_count"])
    key, value = int(meta[p + "attention.key_length"]), int(meta[p + "attention.value_length"])
    if p + "attention.key_length_mla" in meta:
        if (key, value) != (rank + rope, rank):
            raise ValueError(
                f"GGUF {p}attention.key_length / value_length ({key} / {value}): expected kv_lora_rank + rotary "
                f"dimensions / kv_lora_rank ({rank + rope} / {rank})"
            )
        key, value = int(meta[p + "attention.key_length_mla"]), int(meta[p + "attention.value_length_mla"])
    # the decoder's fields as for one K/V head of the latent and the rotary key (what it caches)
    plain = {k: v for k, v in meta.items() if not k.endswith(("attention.value_length", "yarn_log_multiplier"))}
    plain.update({p + "attention.head_count_kv": 1, p + "attention.key_length": rank + rope})
    fields = gguf_decoder_fields(plain, tensor_names, g_arch, arch, partial_rotary=True)
    fields.update(
        attention_bias="blk.0.attn_kv_a_mqa.bias" in tensor_names,
        qk_norm=False,
        rope_interleaved=True,
        mla_kv_lora_rank=rank,
        mla_q_lora_rank=int(meta.get(p + "attention.q_lora_rank") or 0),
        mla_qk_nope_head_dim=key - rope,
        mla_qk_rope_head_dim=rope,
        mla_v_head_dim=value,
    )
    log_mul = meta.get(p + "rope.scaling.yarn_log_multiplier")
    if log_mul is not None:
        scaling = fields["rope_scaling"]
        if scaling is None or scaling["rope_type"] != "yarn":
            raise ValueError(f"GGUF {p}rope.scaling.yarn_log_multiplier without YaRN scaling")
        m_all = float(f"{float(log_mul) / 0.1:.7g}")  # to the float32 metadata's 7 significant digits
        scaling.update(mscale=m_all, mscale_all_dim=m_all)
    experts = gguf_moe_fields(g_arch, meta, tensor_names)
    if experts.get("router_scoring") != "sigmoid" or not experts.get("router_selection_bias"):
        raise ValueError(
            f"GGUF {p}expert_gating_func={meta.get(p + 'expert_gating_func')!r} without a selection bias "
            "(exp_probs_b): DeepSeek-V2's routing is not supported (DeepSeek-V3's sigmoid routing only)"
        )
    return join_fields(fields, experts, {"router_norm_epsilon": 1e-20})


FAMILY = ConfigFamily(
    architectures=("DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM"),
    hf_fields=_hf_fields,
    model_types={
        "deepseek_v3": "DeepseekV3ForCausalLM",
        "kimi_k2": "DeepseekV3ForCausalLM",
        "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
    },
    gguf_architectures={"deepseek2": "DeepseekV3ForCausalLM"},
    gguf_fields=_gguf_fields,
)
