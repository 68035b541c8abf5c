"""Mamba2 (model/mamba2.py: a state-space mixer in every layer): its config.json and GGUF readers,
and the mixer's fields as the Mamba2 hybrids (Bamba, Falcon-H1) name them."""

from __future__ import annotations

from typing import Any

from .common import json_float
from .family import ConfigFamily
from .rope import rope_settings

# How the mixer gates its scan output y with silu(gate) before out_proj: gated then the group RMS
# norm (Mamba2, Bamba; Falcon-H1 with mamba_norm_before_gate false), the norm then gated
# (Falcon-H1's default where mamba_rms_norm), or gated without a norm (Falcon-H1 without it).
SSM_NORMS = ("gate_then_norm", "norm_then_gate", "none")


def _hf_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    """A Mamba2 config.json (transformers' Mamba2Config names and defaults) as ModelConfig fields."""
    hidden = int(d.get("hidden_size", 768))
    intermediate = int(d.get("expand", 2) * hidden)
    heads, head_dim = int(d.get("num_heads", 128)), int(d.get("head_dim", 64))
    if heads * head_dim != intermediate:
        raise ValueError(
            f"Mamba2ForCausalLM with num_heads x head_dim ({heads} x {head_dim}) != expand x hidden_size "
            f"({intermediate}) is not supported"
        )
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"Mamba2ForCausalLM with hidden_act={d.get('hidden_act')!r} is not supported (silu only)")
    groups = int(d.get("n_groups", 8))
    if heads % groups:
        raise ValueError(f"Mamba2ForCausalLM with num_heads ({heads}) not a multiple of n_groups ({groups})")
    state = int(d.get("state_size", 128))
    if state < 1:  # a mixer without a state is no Mamba2 (and its decoder class needs one)
        raise ValueError(f"Mamba2ForCausalLM with state_size={state} is not supported")
    limit = d.get("time_step_limit") or (0.0, float("inf"))
    return dict(
        architecture="Mamba2ForCausalLM",
        vocab_size=int(d.get("vocab_size", 32768)),
        hidden_size=hidden,
        num_hidden_layers=int(d.get("num_hidden_layers", 64)),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        rms_norm_eps=float(d.get("layer_norm_epsilon", 1e-5)),
        max_position_embeddings=int(d.get("max_position_embeddings", 1 << 20)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id", []),
        ssm_state_size=state,
        ssm_n_groups=groups,
        ssm_conv_kernel=int(d.get("conv_kernel", 4)),
        ssm_use_conv_bias=bool(d.get("use_conv_bias", True)),
        ssm_use_bias=bool(d.get("use_bias", False)),
        ssm_time_step_limit=(json_float(limit[0]), json_float(limit[1])),
        residual_in_fp32=bool(d.get("residual_in_fp32", True)),
    )


def _gguf_fields(meta: dict[str, Any], tensor_names: set[str], g_arch: str, arch: str) -> dict[str, Any]:
    """The fields of a `mamba2` GGUF (llama.cpp's convert_hf_to_gguf.py Mamba2Model): heads =
    `ssm.time_step_rank`, inner size `ssm.inner_size` split evenly among them, B/C groups
    `ssm.group_count`. llama.cpp clamps no time step and has no in/out projection biases."""
    p = "mamba2."
    missing = [
        k
        for k in (
            "embedding_length",
            "ssm.inner_size",
            "ssm.state_size",
            "ssm.time_step_rank",
            "ssm.conv_kernel",
            "ssm.group_count",
            "attention.layer_norm_rms_epsilon",
        )
        if p + k not in meta
    ]
    if missing:
        raise ValueError(f"GGUF mamba2 metadata misses {', '.join(p + k for k in missing)}")
    inner, heads = int(meta[p + "ssm.inner_size"]), int(meta[p + "ssm.time_step_rank"])
    groups = int(meta[p + "ssm.group_count"])
    if heads < 1 or inner % heads:
        raise ValueError(f"GGUF {p}ssm.inner_size ({inner}) is not a multiple of {p}ssm.time_step_rank ({heads})")
    if groups < 1 or heads % groups:
        raise ValueError(f"GGUF {p}ssm.time_step_rank ({heads}) is not a multiple of {p}ssm.group_count ({groups})")
    state = int(meta[p + "ssm.state_size"])
    if state < 1:
        raise ValueError(f"GGUF {p}ssm.state_size={state} is not supported")
    if any(n in tensor_names for n in ("blk.0.ssm_in.bias", "blk.0.ssm_out.bias")):
        raise ValueError("GGUF mamba2 with in/out projection biases is not supported (llama.cpp reads none)")
    return dict(
        architecture="Mamba2ForCausalLM",
        hidden_size=int(meta[p + "embedding_length"]),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=inner // heads,
        intermediate_size=inner,
        rms_norm_eps=float(meta[p + "attention.layer_norm_rms_epsilon"]),
        max_position_embeddings=int(meta.get(p + "context_length", 1 << 20)),
        ssm_state_size=state,
        ssm_n_groups=groups,
        ssm_conv_kernel=int(meta[p + "ssm.conv_kernel"]),
        ssm_use_conv_bias="blk.0.ssm_conv1d.bias" in tensor_names,
        ssm_use_bias=False,
        residual_in_fp32=True,
    )


def hf_hybrid_fields(
    d: dict[str, Any], arch: str, ssm_intermediate: int, unsupported: tuple[tuple[str, Any], ...]
) -> dict[str, Any]:
    """What Bamba and Falcon-H1 configs (transformers' names and defaults) share as ModelConfig
    fields: the attention's and the MLP's sizes, rotary, and the Mamba2 mixer's heads, groups,
    conv and time-step limit; `unsupported`: (key, the one value supported) pairs refused by name."""
    hidden = int(d.get("hidden_size", 4096))
    n_heads = int(d.get("num_attention_heads", 32))
    ssm_heads = int(d.get("mamba_n_heads", 128))
    ssm_head_dim = d.get("mamba_d_head", "auto")
    ssm_head_dim = ssm_intermediate // ssm_heads if ssm_head_dim in (None, "auto") else int(ssm_head_dim)
    for key, supported in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False), *unsupported):
        if d.get(key, supported) != supported:
            raise ValueError(f"{arch} with {key}={d.get(key)!r} is not supported ({supported!r} only)")
    groups = int(d.get("mamba_n_groups", 1))
    if ssm_heads % groups:
        raise ValueError(f"{arch} with mamba_n_heads ({ssm_heads}) not a multiple of mamba_n_groups ({groups})")
    rope_theta, scaling, _ = rope_settings(d)
    if scaling is not None:
        raise ValueError(f"{arch} with rope scaling {scaling!r} is not supported")
    limit = d.get("time_step_limit") or (0.0, float("inf"))
    return dict(
        architecture=arch,
        vocab_size=int(d.get("vocab_size", 128000)),
        hidden_size=hidden,
        num_hidden_layers=int(d.get("num_hidden_layers", 32)),
        num_attention_heads=n_heads,
        num_key_value_heads=int(d.get("num_key_value_heads") or n_heads),
        head_dim=int(d.get("head_dim") or hidden // n_heads),
        intermediate_size=int(d.get("intermediate_size", 14336)),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
        rope_theta=rope_theta,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=d.get("bos_token_id", 1),
        eos_token_id=d.get("eos_token_id", 2),
        ssm_state_size=int(d.get("mamba_d_state", 256)),
        ssm_num_heads=ssm_heads,
        ssm_head_dim=ssm_head_dim,
        ssm_intermediate_size=ssm_intermediate,
        ssm_n_groups=groups,
        ssm_conv_kernel=int(d.get("mamba_d_conv", 4)),
        ssm_use_conv_bias=bool(d.get("mamba_conv_bias", True)),
        ssm_time_step_limit=(json_float(limit[0]), json_float(limit[1])),
    )


FAMILY = ConfigFamily(
    architectures=("Mamba2ForCausalLM",),
    hf_fields=_hf_fields,
    model_types={"mamba2": "Mamba2ForCausalLM"},
    gguf_architectures={"mamba2": "Mamba2ForCausalLM"},
    gguf_fields=_gguf_fields,
)
