"""The transformers name of each GGUF tensor, per llama.cpp architecture (`general.architecture`),
and the changes llama.cpp's converter made to a tensor that the loader undoes (Q/K row
permutations, Mamba2's A, D, conv and norm shapes). A family whose tensors need more than a name
has a module of its own (model/gguf_delta_net.py)."""

from __future__ import annotations

import re

import numpy as np

from .configs.phi3 import GGUF_LONG_FACTOR, GGUF_SHORT_FACTOR

# LongRoPE's factors, which llama.cpp keeps as tensors: their values read into the metadata the
# config reader sees, under configs/phi3.py's keys
ROPE_FACTOR_TENSORS = {"rope_factors_long.weight": GGUF_LONG_FACTOR, "rope_factors_short.weight": GGUF_SHORT_FACTOR}
GGUF_LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # mixture of experts (model/moe.py): the router, all experts stacked [E, ...] per matrix, and
    # Qwen2-MoE's shared expert with its gate
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "exp_probs_b.bias": "mlp.expert_bias",  # a sigmoid router's selection bias (GLM-4.5, MiniMax-M2)
}
# older Mixtral GGUFs: one tensor per expert, blk.N.ffn_gate.E.weight
_GGUF_ONE_EXPERT_RE = re.compile(r"^ffn_(gate|up|down)\.(\d+)\.weight$")
GGUF_GLOBAL_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Gemma's sandwich norms: llama.cpp names the norm before the MLP ffn_norm (Llama's
# post_attention_layernorm) and the norms after attention and after the MLP post_*
_GGUF_GEMMA_LAYER_MAP = {
    **GGUF_LAYER_MAP,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Mamba2 (convert_hf_to_gguf.py Mamba2Model): transformers' backbone.* names
_GGUF_MAMBA2_LAYER_MAP = {
    "attn_norm.weight": "norm.weight",
    "ssm_in.weight": "mixer.in_proj.weight",
    "ssm_conv1d.weight": "mixer.conv1d.weight",
    "ssm_conv1d.bias": "mixer.conv1d.bias",
    "ssm_dt.bias": "mixer.dt_bias",
    "ssm_a": "mixer.A_log",
    "ssm_d": "mixer.D",
    "ssm_norm.weight": "mixer.norm.weight",
    "ssm_out.weight": "mixer.out_proj.weight",
}
_GGUF_MAMBA2_GLOBAL_MAP = {
    "token_embd.weight": "backbone.embeddings.weight",
    "output_norm.weight": "backbone.norm_f.weight",
    "output.weight": "lm_head.weight",
}
# gpt-oss (convert_hf_to_gguf.py GptOssModel): the norm before the experts is post_attention_norm;
# each expert matrix stacked [E, out, in] with its bias [E, out], gate and up apart or (a converter
# option) as one gate-then-up tensor; model/gpt_oss.py's expert_tensors joins gate and up
_GGUF_GPT_OSS_LAYER_MAP = {
    **{k: v for k, v in GGUF_LAYER_MAP.items() if not k.startswith("ffn_")},
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_inp.bias": "mlp.router.bias",
    **{
        f"ffn_{matrix}_exps.{kind}": f"mlp.experts.{matrix}_{kind}"
        for matrix in ("gate", "up", "gate_up", "down")
        for kind in ("weight", "bias")
    },
}
# Gemma 4 (convert_hf_to_gguf.py Gemma4Model): Gemma's sandwich norms, the MoE layers' second
# norms, the router's scale and each expert's (on the router here: Gemma4Router), the layer's
# output scale and its per-layer input's gate, projection and norm
_GGUF_GEMMA4_LAYER_MAP = {
    **_GGUF_GEMMA_LAYER_MAP,
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_gate_up_exps.weight": "experts.gate_up_proj",
    "ffn_down_exps.weight": "experts.down_proj",
    "layer_output_scale.weight": "layer_scalar",
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
}
_GGUF_GEMMA4_GLOBAL_MAP = {
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}
GGUF_LAYER_MAPS = {
    # Granite 4: Bamba's layers (the mixers under mamba.), routed experts and the shared MLP
    "granitehybrid": {
        **GGUF_LAYER_MAP,
        **{k: "mamba." + v.removeprefix("mixer.") for k, v in _GGUF_MAMBA2_LAYER_MAP.items() if k.startswith("ssm_")},
    },
    # LFM2: the gated short convolution's three tensors, attention's output projection o_proj
    "lfm2": {
        **GGUF_LAYER_MAP,
        **{
            f"shortconv.{m}.{kind}": f"conv.{m}.{kind}"
            for m in ("conv", "in_proj", "out_proj")
            for kind in ("weight", "bias")
        },
    },
    "gemma2": _GGUF_GEMMA_LAYER_MAP,
    "gemma3": _GGUF_GEMMA_LAYER_MAP,
    "gemma4": _GGUF_GEMMA4_LAYER_MAP,
    "gpt-oss": _GGUF_GPT_OSS_LAYER_MAP,
    # Phi-3 keeps transformers' fused q/k/v and gate/up (model/phi3.py splits them)
    "phi3": {
        **GGUF_LAYER_MAP,
        "attn_qkv.weight": "self_attn.qkv_proj.weight",
        "ffn_up.weight": "mlp.gate_up_proj.weight",
    },
    # GLM-4: a norm on each sublayer's output too; the MLP's gate and up in one tensor
    "glm4": {
        **GGUF_LAYER_MAP,
        "post_attention_norm.weight": "post_self_attn_layernorm.weight",
        "post_ffw_norm.weight": "post_mlp_layernorm.weight",
        "ffn_up.weight": "mlp.gate_up_proj.weight",
    },
    # DeepSeek-V3 / GLM-4.7-Flash: latent attention's projections; its kv_b_proj as one tensor
    # (older files) or split into each head's W_UK transposed and W_UV (model/deepseek.py joins them)
    "deepseek2": {
        **GGUF_LAYER_MAP,
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_q_a.weight": "self_attn.q_a_proj.weight",
        "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
        "attn_q_b.weight": "self_attn.q_b_proj.weight",
        "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attn_kv_a_mqa.bias": "self_attn.kv_a_proj_with_mqa.bias",
        "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
        "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
        "attn_k_b.weight": "self_attn.k_b_proj.weight",
        "attn_v_b.weight": "self_attn.v_b_proj.weight",
    },
    # GLM-4.5: the norm before the MLP named as a norm after attention
    "glm4moe": {**GGUF_LAYER_MAP, "post_attention_norm.weight": "post_attention_layernorm.weight"},
    # OLMo 2: norms after attention and after the MLP, none before
    "olmo2": {
        **GGUF_LAYER_MAP,
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
}
BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.(.+)$")


def gguf_to_hf_name(name: str, g_arch: str = "llama") -> str | None:
    """The transformers name of GGUF tensor `name` in a file of `general.architecture` `g_arch`;
    None for a tensor the model does not read; ValueError for one it cannot place."""
    m = BLOCK_TENSOR.match(name)
    if g_arch == "mamba2":
        if name in _GGUF_MAMBA2_GLOBAL_MAP:
            return _GGUF_MAMBA2_GLOBAL_MAP[name]
        if m and m.group(2) in _GGUF_MAMBA2_LAYER_MAP:
            return f"backbone.layers.{m.group(1)}.{_GGUF_MAMBA2_LAYER_MAP[m.group(2)]}"
        raise ValueError(f"unsupported GGUF tensor {name!r} in a mamba2 file")
    if name in GGUF_GLOBAL_MAP:
        return GGUF_GLOBAL_MAP[name]
    if g_arch == "gemma4" and name in _GGUF_GEMMA4_GLOBAL_MAP:
        return _GGUF_GEMMA4_GLOBAL_MAP[name]
    if g_arch == "lfm2" and name == "token_embd_norm.weight":  # LFM2's final norm, despite its name
        return "model.norm.weight"
    layer_map = GGUF_LAYER_MAPS.get(g_arch, GGUF_LAYER_MAP)
    if m and m.group(2) in layer_map:
        return f"model.layers.{m.group(1)}.{layer_map[m.group(2)]}"
    if m and m.group(2).startswith("nextn."):  # a multi-token-prediction block's own (GLM-4.5): not read
        return None
    one = _GGUF_ONE_EXPERT_RE.match(m.group(2)) if m else None
    if m and one:
        return f"model.layers.{m.group(1)}.mlp.experts.{one.group(2)}.{one.group(1)}_proj.weight"
    if name == "rope_freqs.weight" or name in ROPE_FACTOR_TENSORS:  # read into the config
        return None
    raise ValueError(f"unsupported GGUF tensor {name!r}")


def reverse_llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf Q/K row permutation (as transformers does)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def mamba2_from_gguf(name: str, w: np.ndarray) -> np.ndarray:
    """Undo convert_hf_to_gguf.py's Mamba2 changes: the conv weight squeezed to [channels, kernel]
    (back to [channels, 1, kernel]), A stored as -exp(A_log) and A / D as [heads, 1], the gated
    norm's weight as [groups, inner / groups]."""
    if name.endswith("ssm_conv1d.weight"):
        return w.reshape(w.shape[0], 1, w.shape[-1])
    if name.endswith("ssm_a"):
        if not (w < 0).all():
            raise ValueError(f"GGUF tensor {name!r} holds A = -exp(A_log): every entry must be negative")
        return np.log(-w.astype(np.float64)).astype(np.float32).reshape(-1)
    if name.endswith(("ssm_d", "ssm_norm.weight")):
        return w.reshape(-1)
    return w
