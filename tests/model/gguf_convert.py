"""A transformers model written to GGUF by the rules of llama.cpp's convert_hf_to_gguf.py: Gemma 2,
Gemma 3, Mamba2, gpt-oss, Phi-3, OLMo 2, Granite, SmolLM3 and LFM2 (classes Gemma2Model,
Gemma3Model, Mamba2Model, GptOssModel, Phi3MiniModel, Olmo2Model, GraniteModel, SmolLM3Model,
LFM2Model, LlamaModel and TextModel). It writes the metadata keys each class writes, the tensor names of gguf-py's own
TensorNameMap, and each class's changes to the tensors:
- Gemma's norm weights stored as 1 + w;
- Mamba2's A_log stored as A = -exp(A_log), A and D as [heads, 1], the conv weight squeezed to
  [channels, kernel], the gated norm's weight as [groups, inner / groups], dt_bias named
  dt_proj.bias;
- gpt-oss's experts transposed to [E, out, in], gate and up de-interleaved into two tensors (or,
  the converter's fused option, one gate-then-up tensor), OpenAI's MXFP4 blocks repacked into
  ggml's (a scale byte, then the low nibbles holding values 0-15 and the high ones 16-31);
- Llama's and its subclasses' (Granite, SmolLM3) Q and K rows permuted, biases too;
- Phi-3's LongRoPE factors as tensors.
Tied output weights are left out, as the converter reads them from safetensors (where transformers
does not write them). The vocabulary is a byte-level BPE ("gpt2") one, what the converter writes
for a tokenizer.json (Gemma 2's converter writes SentencePiece): the tokenizer is not what these
files test."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from prefixkv.model.tokenizer import _bytes_to_unicode

GGUF_ARCH = {
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Mamba2ForCausalLM": "mamba2",
    "GptOssForCausalLM": "gpt-oss",
    "Phi3ForCausalLM": "phi3",
    "Olmo2ForCausalLM": "olmo2",
    "GraniteForCausalLM": "granite",
    "SmolLM3ForCausalLM": "smollm3",
    "LlamaForCausalLM": "llama",
    "Ernie4_5ForCausalLM": "ernie4_5",
    "Glm4ForCausalLM": "glm4",
    "Lfm2ForCausalLM": "lfm2",
    "Qwen3NextForCausalLM": "qwen3next",
    "Qwen3_5ForCausalLM": "qwen35",
    "Qwen3_5MoeForCausalLM": "qwen35moe",
    "Glm4MoeForCausalLM": "glm4moe",
    "MiniMaxM2ForCausalLM": "minimax-m2",
}
# LlamaModel and its subclasses: Q and K (weights and biases) permuted for llama.cpp's rotary
_PERMUTED = ("llama", "granite", "smollm3")


def _metadata(w: Any, cfg: Any, g_arch: str) -> None:
    import gguf

    d = cfg.to_dict()
    n = cfg.num_hidden_layers
    w.add_block_count(n)
    if g_arch == "mamba2":  # Mamba2Model.set_gguf_parameters
        d_model = d["hidden_size"]
        d_inner = d.get("intermediate_size") or 2 * d_model
        w.add_context_length(2**20)
        w.add_embedding_length(d_model)
        w.add_feed_forward_length(0)
        w.add_head_count(0)
        w.add_ssm_conv_kernel(d.get("conv_kernel") or 4)
        w.add_ssm_inner_size(d_inner)
        w.add_ssm_state_size(d.get("state_size") or 128)
        w.add_ssm_time_step_rank(d_inner // (d.get("head_dim") or 64))
        w.add_ssm_group_count(d.get("n_groups") or 1)
        w.add_layer_norm_rms_eps(d.get("layer_norm_epsilon") or 1e-5)
        return
    if g_arch in ("phi3", "olmo2", "granite", "smollm3", "llama", "ernie4_5", "glm4"):
        _dense_metadata(w, d, g_arch)
        return
    if g_arch == "lfm2":  # TextModel, then LFM2Model: K/V heads per layer (0: a convolution)
        from prefixkv.model.configs.lfm2 import mlp_width

        w.add_context_length(d["max_position_embeddings"])
        w.add_embedding_length(d["hidden_size"])
        w.add_head_count(d["num_attention_heads"])
        w.add_head_count_kv([d["num_key_value_heads"] if k != "conv" else 0 for k in d["layer_types"]])
        w.add_rope_freq_base(d["rope_parameters"]["rope_theta"])
        w.add_vocab_size(d["vocab_size"])
        w.add_shortconv_l_cache(d["conv_L_cache"])
        w.add_layer_norm_rms_eps(d["norm_eps"])
        w.add_feed_forward_length(mlp_width(d))
        return
    w.add_context_length(d["max_position_embeddings"])
    w.add_embedding_length(d["hidden_size"])
    w.add_feed_forward_length(d["intermediate_size"])
    w.add_head_count(d["num_attention_heads"])
    w.add_head_count_kv(d["num_key_value_heads"])
    w.add_layer_norm_rms_eps(d["rms_norm_eps"])
    w.add_key_length(d["head_dim"])
    w.add_value_length(d["head_dim"])
    if g_arch == "gpt-oss":  # TextModel (experts, YaRN), then GptOssModel
        rope = d["rope_parameters"]
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_expert_count(d["num_local_experts"])
        w.add_expert_used_count(d["num_experts_per_tok"])
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_sliding_window(d["sliding_window"])
        w.add_expert_feed_forward_length(d["intermediate_size"])
        return
    if g_arch == "gemma2":  # Gemma2Model: no rope keys (llama.cpp's default base, 10,000)
        w.add_attn_logit_softcapping(d["attn_logit_softcapping"])
        w.add_final_logit_softcapping(d["final_logit_softcapping"])
        w.add_sliding_window(d["sliding_window"])
        return
    # Gemma3Model after TextModel: rope of the full layers (scaling, base), the sliding layers' base
    rope = d["rope_parameters"]
    full = rope.get("full_attention", rope)
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    w.add_rope_freq_base(full.get("rope_theta", 1_000_000.0))
    if (local := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        w.add_rope_freq_base_swa(local)
    assert d.get("attn_logit_softcapping") is None  # the converter asserts it too
    if d.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(d["final_logit_softcapping"])
    if d.get("sliding_window_pattern") != 1:
        w.add_sliding_window(d["sliding_window"])


def _dense_metadata(w: Any, d: dict[str, Any], g_arch: str) -> None:
    """TextModel's keys, then LlamaModel's (granite, smollm3: vocabulary size, rotary dimensions),
    GraniteModel's scales, or Phi3MiniModel's own set (no head size: hidden / heads; rotary over a
    share of it; LongRoPE's attention factor, its factors being tensors)."""
    rope = d.get("rope_parameters") or {}
    heads = d["num_attention_heads"]
    w.add_context_length(d["max_position_embeddings"])
    w.add_embedding_length(d["hidden_size"])
    w.add_feed_forward_length(d["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(d["num_key_value_heads"])
    w.add_layer_norm_rms_eps(d["rms_norm_eps"])
    w.add_rope_freq_base(rope.get("rope_theta", d.get("rope_theta")))
    head = d["hidden_size"] // heads
    if g_arch == "phi3":
        original = d["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * d["hidden_size"]) // heads)
        w.add_sliding_window(d.get("sliding_window") or 0)
        if rope.get("rope_type") == "longrope":
            scale = d["max_position_embeddings"] / original
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        return
    if d.get("head_dim"):
        w.add_key_length(d["head_dim"])
        w.add_value_length(d["head_dim"])
        head = d["head_dim"]
    if g_arch in _PERMUTED:
        w.add_vocab_size(d["vocab_size"])
        w.add_rope_dimension_count(head)
    if g_arch == "glm4":  # Glm4Model: rotary over a share of each head
        w.add_rope_dimension_count(int(head * rope.get("partial_rotary_factor", 0.5)))
    if g_arch == "granite":
        w.add_attention_scale(d["attention_multiplier"])
        w.add_embedding_scale(d["embedding_multiplier"])
        w.add_residual_scale(d["residual_multiplier"])
        w.add_logit_scale(d["logits_scaling"])


def _llama_permute(a: np.ndarray, n_head: int) -> np.ndarray:
    """LlamaModel.permute: each head's rotary halves interleaved."""
    return a.reshape(n_head, 2, a.shape[0] // n_head // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def _vocabulary(w: Any, vocab: int, bos: int, eos: int) -> None:
    toks = sorted(_bytes_to_unicode().values()) + ["<s>", "</s>"] + [f"<extra_{i}>" for i in range(vocab - 258)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_types([1] * 256 + [3] * (vocab - 256))
    w.add_token_merges([])
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(False)


def _tensor(name: str, a: np.ndarray, g_arch: str, cfg: Any) -> np.ndarray:
    """One tensor as the architecture's modify_tensors changes it (`name`: transformers')."""
    if g_arch in _PERMUTED and ".self_attn.q_proj." in name:
        return _llama_permute(a, cfg.num_attention_heads)
    if g_arch in _PERMUTED and ".self_attn.k_proj." in name:
        return _llama_permute(a, cfg.num_key_value_heads)
    if g_arch in ("gemma2", "gemma3"):
        return a + 1 if name.endswith("norm.weight") else a
    if g_arch == "lfm2" and name.endswith("conv.conv.weight"):
        return a.squeeze(1)
    if name.endswith(".A_log"):
        a = -np.exp(a)
    if name.endswith("conv1d.weight"):
        return a.squeeze()
    if name.endswith((".A_log", ".D")):
        return a.reshape(*a.shape, 1)
    if name.endswith("mixer.norm.weight"):
        inner = a.shape[0]
        return a.reshape(cfg.n_groups, inner // cfg.n_groups)
    return a


def _quantizable(gguf_name: str, a: np.ndarray) -> bool:
    """What the converter quantizes at --outtype q8_0: matrices (not norms, not the conv kernel),
    whose rows fill whole Q8_0 blocks."""
    if a.ndim < 2 or gguf_name.endswith("_norm.weight") or ".ssm_conv1d." in gguf_name:
        return False
    return a.shape[-1] % 32 == 0


def _gpt_oss_experts(
    layer: int, name: str, a: np.ndarray, fused: bool, mxfp4: dict[str, tuple[np.ndarray, np.ndarray]] | None
) -> list[tuple[str, np.ndarray, Any]]:
    """GptOssModel's expert tensors for one transformers expert tensor: (GGUF name, data, raw
    dtype or None). `mxfp4` holds OpenAI's (blocks, scales) of the matrices that were MXFP4."""
    import gguf

    p = f"blk.{layer}.ffn_"
    matrix = name.rpartition(".")[2]  # gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias
    if matrix.endswith("_bias"):
        if matrix == "down_proj_bias":
            return [(p + "down_exps.bias", a, None)]
        gate, up = a[..., 0::2], a[..., 1::2]
        if fused:
            return [(p + "gate_up_exps.bias", np.concatenate((gate, up), axis=-1), None)]
        return [(p + "gate_exps.bias", gate, None), (p + "up_exps.bias", up, None)]
    if mxfp4 is not None and name in mxfp4:
        blocks, scales = mxfp4[name]  # [E, rows, G, 16], [E, rows, G]
        if matrix == "down_proj":
            return [(p + "down_exps.weight", _ggml_mxfp4(blocks, scales), gguf.GGMLQuantizationType.MXFP4)]
        halves = [(blocks[:, 0::2], scales[:, 0::2]), (blocks[:, 1::2], scales[:, 1::2])]
        if fused:
            packed = np.concatenate([_ggml_mxfp4(b, s) for b, s in halves], axis=1)
            return [(p + "gate_up_exps.weight", packed, gguf.GGMLQuantizationType.MXFP4)]
        return [
            (p + f"{half}_exps.weight", _ggml_mxfp4(b, s), gguf.GGMLQuantizationType.MXFP4)
            for half, (b, s) in zip(("gate", "up"), halves)
        ]
    a = np.ascontiguousarray(np.swapaxes(a, -1, -2))  # [E, out, in]
    if matrix == "down_proj":
        return [(p + "down_exps.weight", a, None)]
    gate, up = a[:, 0::2], a[:, 1::2]
    if fused:
        return [(p + "gate_up_exps.weight", np.concatenate((gate, up), axis=1), None)]
    return [(p + f"{half}_exps.weight", np.ascontiguousarray(x), None) for half, x in (("gate", gate), ("up", up))]


def _ggml_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """OpenAI's MXFP4 (blocks [..., G, 16]: value 2j in byte j's low nibble, 2j + 1 in its high
    one) as ggml's block_mxfp4 bytes [..., G * 17]: the scale, then value j in byte j's low nibble
    and value j + 16 in its high one."""
    codes = np.empty((*blocks.shape[:-1], 32), dtype=np.uint8)
    codes[..., 0::2] = blocks & 0x0F
    codes[..., 1::2] = blocks >> 4
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    packed = np.concatenate((scales[..., None], qs), axis=-1)  # [..., G, 17]
    return np.ascontiguousarray(packed.reshape(*packed.shape[:-2], -1))


# transformers' attention names (below model.layers.N.) -> GGUF's
_ATTENTION_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}


def write_delta_net_gguf(path: Path, hf: Any, mtp_blocks: int = 0) -> None:
    """A transformers Qwen3NextForCausalLM / Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM (float32)
    as a GGUF file by Qwen3NextModel's rules (Qwen3.5: _LinearAttentionVReorderBase's, then those),
    with `mtp_blocks` stand-in multi-token-prediction blocks appended (their tensors' names, as
    _Qwen35MtpMixin writes them)."""
    import gguf

    cfg = hf.config
    d = cfg.to_dict()
    g_arch = GGUF_ARCH[type(hf).__name__]
    n = cfg.num_hidden_layers
    Hk, Hv = d["linear_num_key_heads"], d["linear_num_value_heads"]
    dk, dv, r = d["linear_key_head_dim"], d["linear_value_head_dim"], Hv // Hk
    w = gguf.GGUFWriter(str(path), g_arch)
    w.add_block_count(n + mtp_blocks)
    w.add_context_length(d["max_position_embeddings"])
    w.add_embedding_length(d["hidden_size"])
    w.add_feed_forward_length(d.get("intermediate_size") or 0)
    w.add_head_count(d["num_attention_heads"])
    w.add_head_count_kv(d["num_key_value_heads"])
    w.add_rope_freq_base((d.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(d["rms_norm_eps"])
    w.add_key_length(d["head_dim"])
    w.add_value_length(d["head_dim"])
    if d.get("num_experts"):  # Qwen2MoeModel
        w.add_expert_count(d["num_experts"])
        w.add_expert_used_count(d["num_experts_per_tok"])
        w.add_expert_feed_forward_length(d["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(d["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(d["linear_conv_kernel_dim"])
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(Hk)
    w.add_ssm_time_step_rank(Hv)
    w.add_ssm_inner_size(dv * Hv)
    kinds = d["layer_types"]
    w.add_full_attention_interval(next(i + 1 for i, k in enumerate(kinds) if k == "full_attention"))
    partial = (d.get("rope_parameters") or {}).get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))
    w.add_rope_dimension_count(int(d["head_dim"] * partial))
    if g_arch != "qwen3next":
        w.add_rope_dimension_sections([11, 11, 10, 0])
        if mtp_blocks:
            w.add_nextn_predict_layers(mtp_blocks)
    _vocabulary(w, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    tiled = g_arch != "qwen3next" and r > 1

    def tile(a: np.ndarray, axis: int, head: int) -> np.ndarray:  # _reorder_v_heads: grouped -> tiled
        shape = a.shape
        grouped = a.reshape(*shape[:axis], Hk, r, head, *shape[axis + 1 :])
        return np.ascontiguousarray(np.swapaxes(grouped, axis, axis + 1)).reshape(shape)

    names = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        **_ATTENTION_NAMES,
        "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
        "linear_attn.in_proj_z.weight": "attn_gate.weight",
        "linear_attn.in_proj_b.weight": "ssm_beta.weight",
        "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
        "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
        "linear_attn.A_log": "ssm_a",
        "linear_attn.dt_bias": "ssm_dt.bias",
        "linear_attn.conv1d.weight": "ssm_conv1d.weight",
        "linear_attn.norm.weight": "ssm_norm.weight",
        "linear_attn.out_proj.weight": "ssm_out.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
        "mlp.gate.weight": "ffn_gate_inp.weight",
        "mlp.experts.down_proj": "ffn_down_exps.weight",
        "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
        "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
        "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
        "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    }
    for name, t in hf.state_dict().items():
        a = t.float().numpy()
        if name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                w.add_tensor("output.weight", a)
            continue
        if name == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", a)
            continue
        if name == "model.norm.weight":
            w.add_tensor("output_norm.weight", a + 1)
            continue
        layer, _, rest = name.removeprefix("model.layers.").partition(".")
        p = f"blk.{layer}."
        if rest == "linear_attn.in_proj_qkvz.weight":  # Qwen3-Next: [q, k, v, z] per q/k head
            groups = a.reshape(Hk, 2 * dk + 2 * r * dv, -1)
            q, k, v, z = np.split(groups, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
            qkv = np.concatenate([x.reshape(-1, a.shape[1]) for x in (q, k, v)])
            w.add_tensor(p + "attn_qkv.weight", qkv)
            w.add_tensor(p + "attn_gate.weight", np.ascontiguousarray(z.reshape(-1, a.shape[1])))
            continue
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H], gate rows first
            gate, up = np.split(a, 2, axis=1)
            w.add_tensor(p + "ffn_gate_exps.weight", np.ascontiguousarray(gate))
            w.add_tensor(p + "ffn_up_exps.weight", np.ascontiguousarray(up))
            continue
        if tiled:
            if rest == "linear_attn.in_proj_qkv.weight":
                a = np.concatenate((a[: 2 * Hk * dk], tile(a[2 * Hk * dk :], 0, dv)))
            elif rest == "linear_attn.in_proj_z.weight":
                a = tile(a, 0, dv)
            elif rest in ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight"):
                a = tile(a, 0, 1)
            elif rest in ("linear_attn.A_log", "linear_attn.dt_bias"):
                a = tile(a, 0, 1)
            elif rest == "linear_attn.conv1d.weight":
                a = a.squeeze()
                a = np.concatenate((a[: 2 * Hk * dk], tile(a[2 * Hk * dk :], 0, dv)))
            elif rest == "linear_attn.out_proj.weight":
                a = tile(a, 1, dv)
        if rest == "linear_attn.A_log":
            a = -np.exp(a)
        elif rest == "linear_attn.conv1d.weight":
            a = a.squeeze()
        elif rest.endswith("norm.weight") and rest != "linear_attn.norm.weight":
            a = a + 1
        elif rest == "mlp.shared_expert_gate.weight":
            a = a.reshape(-1)
        w.add_tensor(p + names[rest], np.ascontiguousarray(a, dtype=np.float32))
    _prediction_blocks_and_file(w, cfg, mtp_blocks)


def write_granite_hybrid_gguf(path: Path, hf: Any) -> None:
    """A transformers GraniteMoeHybridForCausalLM (float32) as a GGUF file by GraniteHybridModel's
    rules: GraniteMoeModel's and Mamba2Model's keys, K/V heads per layer (0 on a Mamba2 layer),
    `rope.scaling.finetuned` for rotary, Q and K permuted (LlamaModel: invisible without rotary,
    as the same permutation of q's and k's head dimensions leaves their products), the mixers'
    tensors as Mamba2Model writes them, the experts' and the shared MLP's fused gate/up split."""
    import gguf

    cfg = hf.config
    d = cfg.to_dict()
    n, heads, hidden = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.hidden_size
    attention = [i for i, k in enumerate(cfg.layer_types) if k != "linear_attention"]
    # the converter's rule: rotary for Bamba or a model without Mamba2 layers, whatever the config says
    use_rope = "BambaForCausalLM" in (cfg.architectures or []) or len(attention) == n
    experts = d.get("num_local_experts") or 0
    w = gguf.GGUFWriter(str(path), "granitehybrid")
    w.add_block_count(n)
    w.add_context_length(d["max_position_embeddings"] if use_rope else 2**20)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(d["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv([d["num_key_value_heads"] if i in attention else 0 for i in range(n)])
    w.add_rope_freq_base((d.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(d["rms_norm_eps"])
    w.add_vocab_size(d["vocab_size"])
    w.add_rope_dimension_count(hidden // heads)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(d["num_experts_per_tok"])
    w.add_attention_scale(d["attention_multiplier"])
    w.add_embedding_scale(d["embedding_multiplier"])
    w.add_residual_scale(d["residual_multiplier"])
    w.add_logit_scale(d["logits_scaling"])
    w.add_expert_shared_feed_forward_length(d["shared_intermediate_size"])
    inner = d["mamba_expand"] * hidden
    w.add_ssm_conv_kernel(d["mamba_d_conv"])
    w.add_ssm_state_size(d["mamba_d_state"])
    w.add_ssm_group_count(d["mamba_n_groups"])
    w.add_ssm_inner_size(inner)
    w.add_ssm_time_step_rank(d["mamba_n_heads"])
    w.add_rope_scaling_finetuned(use_rope)
    _vocabulary(w, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    shexp = "_shexp" if experts else ""
    names = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mamba.in_proj.weight": "ssm_in.weight",
        "mamba.conv1d.bias": "ssm_conv1d.bias",
        "mamba.dt_bias": "ssm_dt.bias",
        "mamba.out_proj.weight": "ssm_out.weight",
        "block_sparse_moe.router.weight": "ffn_gate_inp.weight",
        "block_sparse_moe.experts.down_proj": "ffn_down_exps.weight",
        "shared_mlp.output_linear.weight": f"ffn_down{shexp}.weight",
    }
    for name, t in hf.state_dict().items():
        a = t.float().numpy()
        if name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                w.add_tensor("output.weight", a)
            continue
        if name in ("model.embed_tokens.weight", "model.norm.weight"):
            w.add_tensor("token_embd.weight" if "embed" in name else "output_norm.weight", a)
            continue
        layer, _, rest = name.removeprefix("model.layers.").partition(".")
        p = f"blk.{layer}."
        if rest in ("block_sparse_moe.experts.gate_up_proj", "shared_mlp.input_linear.weight"):
            gate, up = np.split(a, 2, axis=-2)
            kind = "_exps" if "experts" in rest else shexp
            w.add_tensor(p + f"ffn_gate{kind}.weight", np.ascontiguousarray(gate))
            w.add_tensor(p + f"ffn_up{kind}.weight", np.ascontiguousarray(up))
            continue
        if rest == "self_attn.q_proj.weight":
            w.add_tensor(p + "attn_q.weight", _llama_permute(a, heads))
        elif rest == "self_attn.k_proj.weight":
            w.add_tensor(p + "attn_k.weight", _llama_permute(a, cfg.num_key_value_heads))
        elif rest == "mamba.conv1d.weight":
            w.add_tensor(p + "ssm_conv1d.weight", np.ascontiguousarray(a.squeeze(1)))
        elif rest == "mamba.A_log":
            w.add_tensor(p + "ssm_a", (-np.exp(a)).reshape(-1, 1))
        elif rest == "mamba.D":
            w.add_tensor(p + "ssm_d", a.reshape(-1, 1))
        elif rest == "mamba.norm.weight":
            w.add_tensor(p + "ssm_norm.weight", a.reshape(d["mamba_n_groups"], -1))
        else:
            w.add_tensor(p + names[rest], a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_gguf(
    path: Path,
    hf: Any,
    quantize: bool = False,
    fused_gate_up: bool = False,
    mxfp4: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
) -> None:
    """`hf` (a transformers Gemma2/Gemma3/Mamba2/GptOssForCausalLM, float32) as a GGUF file at
    `path`, float32, or Q8_0 matrices where `quantize`; gpt-oss's experts with gate and up in one
    tensor where `fused_gate_up`, and the ones named in `mxfp4` (transformers' name -> OpenAI's
    blocks and scales, which `hf` holds dequantized) as ggml MXFP4."""
    import gguf

    cfg = hf.config
    g_arch = GGUF_ARCH[cfg.architectures[0] if cfg.architectures else type(hf).__name__]
    arch_enum = next(a for a, s in gguf.MODEL_ARCH_NAMES.items() if s == g_arch)
    names = gguf.get_tensor_name_map(arch_enum, cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), g_arch)
    _metadata(w, cfg, g_arch)
    _vocabulary(w, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # not in the safetensors the converter reads
        if g_arch == "gpt-oss":
            layer, _, rest = name.removeprefix("model.layers.").partition(".")
            if rest.startswith("mlp.experts."):
                for new_name, data, raw in _gpt_oss_experts(int(layer), name, t.float().numpy(), fused_gate_up, mxfp4):
                    w.add_tensor(new_name, data if raw else data.astype(np.float32), raw_dtype=raw)
                continue
            if rest == "self_attn.sinks":  # GptOssModel.filter_tensors names it sinks.weight
                w.add_tensor(f"blk.{layer}.attn_sinks.weight", t.float().numpy())
                continue
        src = name.rpartition(".dt_bias")[0] + ".dt_proj.bias" if name.endswith(".dt_bias") else name
        new = names.get_name(src, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        a = np.ascontiguousarray(_tensor(name, t.float().numpy(), g_arch, cfg), dtype=np.float32)
        if quantize and _quantizable(new, a):
            w.add_tensor(
                new, gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0
            )
        else:
            w.add_tensor(new, a)
    rope = cfg.to_dict().get("rope_parameters") or {}
    if g_arch == "phi3" and rope.get("rope_type") == "longrope":  # Phi3MiniModel.generate_extra_tensors
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_sigmoid_moe_gguf(path: Path, hf: Any, mtp_blocks: int = 0) -> None:
    """A transformers Glm4MoeForCausalLM or MiniMaxM2ForCausalLM (float32) as a GGUF file by
    Glm4MoeModel's or MiniMaxM2Model's rules: TextModel's keys, then the class's own (GLM-4.5:
    rotary dimensions, expert width, shared expert count, leading dense blocks, sigmoid gating,
    the weights' scale and norm, prediction layers; MiniMax-M2: expert width, rotary dimensions),
    the experts stacked [E, out, in] per matrix, the selection bias as exp_probs_b.bias; with
    `mtp_blocks` stand-in prediction blocks appended (GLM-4.5)."""
    import gguf

    cfg = hf.config
    d = cfg.to_dict()
    g_arch = GGUF_ARCH[type(hf).__name__]
    n = cfg.num_hidden_layers
    glm = g_arch == "glm4moe"
    w = gguf.GGUFWriter(str(path), g_arch)
    w.add_block_count(n + mtp_blocks)
    w.add_context_length(d["max_position_embeddings"])
    w.add_embedding_length(d["hidden_size"])
    w.add_feed_forward_length(d["intermediate_size"])
    w.add_head_count(d["num_attention_heads"])
    w.add_head_count_kv(d["num_key_value_heads"])
    w.add_rope_freq_base(d["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(d["rms_norm_eps"])
    w.add_key_length(d["head_dim"])
    w.add_value_length(d["head_dim"])
    w.add_expert_used_count(d["num_experts_per_tok"])
    rotary = int(d["head_dim"] * d["rope_parameters"]["partial_rotary_factor"])
    if glm:
        w.add_rope_dimension_count(rotary)
        w.add_expert_count(d["n_routed_experts"])
        w.add_expert_feed_forward_length(d["moe_intermediate_size"])
        w.add_expert_shared_count(d["n_shared_experts"])
        w.add_leading_dense_block_count(d["first_k_dense_replace"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(d["routed_scaling_factor"])
        w.add_expert_weights_norm(d["norm_topk_prob"])
        w.add_expert_group_count(d["n_group"])  # (TextModel's, from n_group / topk_group)
        w.add_expert_group_used_count(d["topk_group"])
        if mtp_blocks:
            w.add_nextn_predict_layers(mtp_blocks)
    else:
        w.add_expert_count(d["num_local_experts"])
        w.add_expert_feed_forward_length(d["intermediate_size"])
        w.add_rope_dimension_count(rotary)
    _vocabulary(w, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    names = {
        **_ROUTED_NAMES,
        "post_attention_layernorm.weight": "post_attention_norm.weight" if glm else "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.bias": "attn_v.bias",
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.k_norm.weight": "attn_k_norm.weight",
        "mlp.e_score_correction_bias": "exp_probs_b.bias",
    }
    _write_routed_tensors(w, hf, names, mtp_blocks)


# transformers' names -> GGUF's of what GLM-4.5, MiniMax-M2 and DeepSeek-V3 share
_ROUTED_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}


def _write_routed_tensors(
    w: Any,
    hf: Any,
    names: dict[str, str],
    mtp_blocks: int,
    own: Callable[[str, str, np.ndarray], bool] | None = None,
) -> None:
    """Each tensor of `hf` under its GGUF name (`names`, below blk.N.), the routed experts' fused
    gate/up [E, 2I, H] split into gate and up; `own(prefix, name, array)` writes a tensor itself
    where it returns True; then `mtp_blocks` stand-in prediction blocks, and the file."""
    cfg = hf.config
    for name, t in hf.state_dict().items():
        a = t.float().numpy()
        if name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
            w.add_tensor({"lm_head.weight": "output.weight", "model.embed_tokens.weight": "token_embd.weight"}.get(
                name, "output_norm.weight"), a)  # fmt: skip
            continue
        layer, _, rest = name.removeprefix("model.layers.").partition(".")
        p = f"blk.{layer}."
        if rest == "mlp.experts.gate_up_proj":  # gate rows first
            gate, up = np.split(a, 2, axis=1)
            w.add_tensor(p + "ffn_gate_exps.weight", np.ascontiguousarray(gate))
            w.add_tensor(p + "ffn_up_exps.weight", np.ascontiguousarray(up))
        elif own is None or not own(p, rest, a):
            w.add_tensor(p + names[rest], a)
    _prediction_blocks_and_file(w, cfg, mtp_blocks)


def _prediction_blocks_and_file(w: Any, cfg: Any, mtp_blocks: int) -> None:
    """`mtp_blocks` stand-in multi-token-prediction blocks after the last layer (a norm and the
    nextn projection, as the converters write them), then the file."""
    n = cfg.num_hidden_layers
    for b in range(n, n + mtp_blocks):
        w.add_tensor(f"blk.{b}.attn_norm.weight", np.ones(cfg.hidden_size, dtype=np.float32))
        w.add_tensor(f"blk.{b}.nextn.eh_proj.weight", np.zeros((cfg.hidden_size, 2 * cfg.hidden_size), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_deepseek_gguf(path: Path, hf: Any, split_kv_b: bool = True, mtp_blocks: int = 0) -> None:
    """A transformers DeepseekV3ForCausalLM or Glm4MoeLiteForCausalLM (float32) as a GGUF file by
    DeepseekV2Model's rules ("deepseek2"): one K/V head (key_length kv_lora_rank + rotary
    dimensions, value_length kv_lora_rank, the per-head sizes in key_length_mla /
    value_length_mla), the query's rank, the expert keys (TextModel's groups and sigmoid gating,
    from n_group / topk_group and scoring_func), YaRN with its log multiplier 0.1 mscale_all_dim; kv_b_proj
    split into k_b (each head's W_UK transposed) and v_b where `split_kv_b` (the converter's since
    2025), else whole (files before it, whose key_length / value_length are the per-head sizes);
    the rows as transformers has them; `mtp_blocks` stand-in prediction blocks appended."""
    import gguf

    cfg = hf.config
    d = cfg.to_dict()
    n, H = cfg.num_hidden_layers, cfg.num_attention_heads
    rank, rope, nope, vdim = d["kv_lora_rank"], d["qk_rope_head_dim"], d["qk_nope_head_dim"], d["v_head_dim"]
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_block_count(n + mtp_blocks)
    w.add_context_length(d["max_position_embeddings"])
    w.add_embedding_length(d["hidden_size"])
    w.add_feed_forward_length(d["intermediate_size"])
    w.add_head_count(H)
    w.add_head_count_kv(1)
    params = d.get("rope_parameters") or {}
    w.add_rope_freq_base(params.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(d["rms_norm_eps"])
    w.add_expert_used_count(d["num_experts_per_tok"])
    w.add_expert_group_count(d["n_group"])
    w.add_expert_group_used_count(d["topk_group"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)  # (TextModel's, from scoring_func)
    if params.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(params["factor"])
        w.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(params["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(params["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(0.1 * params["mscale_all_dim"])
    kinds = d.get("mlp_layer_types")
    w.add_leading_dense_block_count(kinds.index("sparse") if kinds else d["first_k_dense_replace"])
    w.add_vocab_size(d["vocab_size"])
    if d.get("q_lora_rank"):
        w.add_q_lora_rank(d["q_lora_rank"])
    w.add_kv_lora_rank(rank)
    if split_kv_b:
        w.add_key_length(rank + rope)
        w.add_value_length(rank)
        w.add_key_length_mla(nope + rope)
        w.add_value_length_mla(vdim)
    else:
        w.add_key_length(nope + rope)
        w.add_value_length(vdim)
    w.add_expert_feed_forward_length(d["moe_intermediate_size"])
    w.add_expert_count(d["n_routed_experts"])
    w.add_expert_shared_count(d["n_shared_experts"])
    w.add_expert_weights_scale(d["routed_scaling_factor"])
    w.add_expert_weights_norm(d["norm_topk_prob"])
    w.add_rope_dimension_count(rope)
    if mtp_blocks:
        w.add_nextn_predict_layers(mtp_blocks)
    _vocabulary(w, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    names = {
        **_ROUTED_NAMES,
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.q_a_proj.weight": "attn_q_a.weight",
        "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
        "self_attn.q_b_proj.weight": "attn_q_b.weight",
        "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
        "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
        "self_attn.kv_b_proj.weight": "attn_kv_b.weight",
    }

    def kv_b_split(p: str, rest: str, a: np.ndarray) -> bool:  # each head's W_UK transposed, and W_UV
        if rest != "self_attn.kv_b_proj.weight" or not split_kv_b:
            return False
        k_b, v_b = np.split(a.reshape(H, nope + vdim, rank), [nope], axis=1)
        w.add_tensor(p + "attn_k_b.weight", np.ascontiguousarray(np.swapaxes(k_b, 1, 2)))
        w.add_tensor(p + "attn_v_b.weight", np.ascontiguousarray(v_b))
        return True

    _write_routed_tensors(w, hf, names, mtp_blocks, kv_b_split)


# transformers' names (below model.layers.N.) -> GGUF's of Gemma 4 (Gemma4Model's tensor map)
_GEMMA4_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
    **_ATTENTION_NAMES,
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "router.proj.weight": "ffn_gate_inp.weight",
    "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight",
    "layer_scalar": "layer_output_scale.weight",
    "per_layer_input_gate.weight": "inp_gate.weight",
    "per_layer_projection.weight": "proj.weight",
    "post_per_layer_input_norm.weight": "post_norm.weight",
}
_GEMMA4_GLOBAL = {
    "embed_tokens.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
}


def write_gemma4_gguf(path: Path, hf: Any) -> None:
    """A transformers Gemma4ForCausalLM (float32) as a GGUF file by Gemma4Model's rules: the full
    layers' head size in key_length and the sliding ones' in key_length_swa, K/V heads one per layer
    where the full layers have their own, MLP widths one per layer where the KV-shared layers' are
    doubled, the sliding pattern as booleans, the proportional rotary as `rope_freqs` divisors (1,
    then 1e30), norms as they are (no 1 added), the router's and experts' scales beside their
    tensors, the vocabulary gguf_convert's byte-level one."""
    import gguf

    cfg = hf.config
    d = cfg.to_dict()
    n, shared = cfg.num_hidden_layers, d.get("num_kv_shared_layers") or 0
    kinds = list(d["layer_types"])
    full = kinds.index("full_attention")
    attn = hf.model.layers[full].self_attn
    global_head, head = attn.head_dim, d["head_dim"]
    global_kv = attn.k_proj.out_features // global_head
    w = gguf.GGUFWriter(str(path), "gemma4")
    w.add_block_count(n)
    w.add_context_length(d["max_position_embeddings"])
    w.add_embedding_length(d["hidden_size"])
    ff = d["intermediate_size"]
    w.add_feed_forward_length([ff if i < n - shared else 2 * ff for i in range(n)] if d["use_double_wide_mlp"] else ff)
    w.add_head_count(d["num_attention_heads"])
    kv = d["num_key_value_heads"]
    w.add_head_count_kv([global_kv if k == "full_attention" else kv for k in kinds] if global_kv != kv else kv)
    w.add_key_length(global_head)
    w.add_value_length(global_head)
    w.add_key_length_swa(head)
    w.add_value_length_swa(head)
    w.add_sliding_window(d["sliding_window"])
    w.add_sliding_window_pattern([k == "sliding_attention" for k in kinds])
    w.add_shared_kv_layers(shared)
    w.add_layer_norm_rms_eps(d["rms_norm_eps"])
    w.add_embedding_length_per_layer_input(d.get("hidden_size_per_layer_input") or 0)
    rope = d["rope_parameters"]
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_rope_dimension_count(global_head)
    w.add_rope_dimension_count_swa(head)
    if d.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(d["final_logit_softcapping"])
    if d.get("enable_moe_block"):
        w.add_expert_count(d["num_experts"])
        w.add_expert_used_count(d["top_k_experts"])
        w.add_expert_feed_forward_length(d["moe_intermediate_size"])
    _vocabulary(w, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    rotating = int(global_head * rope["full_attention"].get("partial_rotary_factor", 1.0) / 2)
    w.add_tensor("rope_freqs.weight", np.array([1.0] * rotating + [1e30] * (global_head // 2 - rotating), np.float32))
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" or "rotary_emb" in name or name.endswith("embed_scale"):
            continue  # tied; buffers the converter does not write
        a = np.ascontiguousarray(t.float().numpy())
        rest = name.removeprefix("model.")
        if rest in _GEMMA4_GLOBAL:
            w.add_tensor(_GEMMA4_GLOBAL[rest], a)
            continue
        layer, _, rest = rest.removeprefix("layers.").partition(".")
        w.add_tensor(f"blk.{layer}.{_GEMMA4_NAMES[rest]}", a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
