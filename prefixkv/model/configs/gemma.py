"""The Gemma family (Gemma 2, Gemma 3 text; model/gemma.py's block: sandwich norms, GeGLU, scaled
embeddings, soft-capping): its config.json and GGUF readers."""

from __future__ import annotations

from typing import Any

from ..layer_kinds import FULL_ATTENTION, SLIDING_ATTENTION
from .common import join_fields
from .decoder import gguf_decoder_fields, hf_decoder_fields, window_if_sliding
from .family import ConfigFamily
from .moe import gguf_moe_fields
from .rope import rope_settings

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


def _hf_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    gemma3 = arch == "Gemma3ForCausalLM"
    rope_theta, scaling, local = rope_settings(d, 1_000_000.0 if gemma3 else 10000.0)
    local_theta = None
    if gemma3:
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"Gemma 3's sliding layers with rope type {local['rope_type']!r} are not supported")
        local_theta = float(local.get("rope_theta", d.get("rope_local_base_freq", 10000.0)))
    window, layer_types = _attention_layers(d, gemma3)
    if d.get("attention_bias", False):
        raise ValueError(f"{arch} with attention_bias=true is not supported")
    if d.get("use_bidirectional_attention"):
        raise ValueError(f"{arch} with use_bidirectional_attention=true (an embedding model) is not supported")
    gemma = dict(
        query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)),
        # transformers' Gemma 3 reads no attention soft-capping (its config key is unused)
        attn_logit_softcapping=None if gemma3 else d.get("attn_logit_softcapping", 50.0),
        final_logit_softcapping=d.get("final_logit_softcapping", None if gemma3 else 30.0),
        rope_local_theta=local_theta,
        hidden_activation=d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh",
    )
    return join_fields(
        hf_decoder_fields(
            d, arch, rope_theta, scaling, window, layer_types, False, qk_norm=gemma3, tie_by_default=True
        ),
        gemma,
    )


def _attention_layers(d: dict[str, Any], gemma3: bool) -> tuple[int | None, list[str]]:
    """(window, per-layer attention kinds) as transformers reads them: Gemma 2 slides on every
    other layer from the first, Gemma 3 on all but every `sliding_window_pattern`-th (window 4096
    where the config has none); an explicit `layer_types` list wins."""
    n = d["num_hidden_layers"]
    window = d.get("sliding_window")
    window = window if window is not None else 4096
    period = d.get("sliding_window_pattern", 6) if gemma3 else 2
    layer_types = list(d.get("layer_types") or [])
    layer_types = layer_types or [SLIDING_ATTENTION if (i + 1) % period else FULL_ATTENTION for i in range(n)]
    return window_if_sliding(window, layer_types)


# llama.cpp's layer counts of the Gemma 27B models, whose attention scale is 1/sqrt(hidden / heads)
# (src/llama-model.cpp; every other size: 1/sqrt(head_dim)). The file carries no scale of its own.
_GGUF_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gguf_fields(meta: dict[str, Any], tensor_names: set[str], g_arch: str, arch: str) -> dict[str, Any]:
    p = g_arch + "."
    experts = gguf_moe_fields(g_arch, meta, tensor_names)
    fields = gguf_decoder_fields(meta, tensor_names, g_arch, arch)
    if "blk.0.attn_q.bias" in tensor_names:
        raise ValueError(f"GGUF {g_arch!r} with attention biases is not supported")
    if p + "attention.layer_norm_rms_epsilon" not in meta:  # llama.cpp requires it too
        raise ValueError(f"GGUF metadata misses {p}attention.layer_norm_rms_epsilon")
    if (g_arch == "gemma3") != ("blk.0.attn_q_norm.weight" in tensor_names):
        raise ValueError(f"GGUF {g_arch!r} {'without' if g_arch == 'gemma3' else 'with'} Q/K norms is not supported")
    gemma = _gguf_gemma_fields(g_arch, meta, fields["hidden_size"], fields["num_attention_heads"], fields["head_dim"])
    return join_fields(fields, experts, gemma)


def _gguf_gemma_fields(g_arch: str, meta: dict[str, Any], hidden: int, n_heads: int, head_dim: int) -> dict[str, Any]:
    """The Gemma fields of a `gemma2` / `gemma3` GGUF, read as llama.cpp reads them: Gemma 2 slides
    on every other layer from the first (window 4096 where the file has none), caps attention
    scores (default 50) and logits (default 30); Gemma 3 slides on all but every
    `attention.sliding_window_pattern`-th layer (default 6; a per-layer list of booleans says it
    layer by layer; no window: every layer full), its sliding layers on `rope.freq_base_swa`
    (default 10,000), no attention cap, the logit cap only where the file has one."""
    p = g_arch + "."
    n = int(meta[p + "block_count"])
    layers_27b = _GGUF_GEMMA_27B_LAYERS[g_arch]
    scalar = hidden // n_heads if n == layers_27b else head_dim
    fields: dict[str, Any] = dict(query_pre_attn_scalar=float(scalar), hidden_activation="gelu_pytorch_tanh")
    window = meta.get(p + "attention.sliding_window")
    local_theta = meta.get(p + "rope.freq_base_swa")
    if g_arch == "gemma2":
        window = 4096 if window is None else int(window)
        layer_types = [SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(n)]
        fields.update(
            attn_logit_softcapping=float(meta.get(p + "attn_logit_softcapping", 50.0)),
            final_logit_softcapping=float(meta.get(p + "final_logit_softcapping", 30.0)),
        )
    else:
        if meta.get(p + "attn_logit_softcapping") is not None:
            raise ValueError(
                f"GGUF {p}attn_logit_softcapping is not supported: Gemma 3 caps no attention scores "
                "(transformers and llama.cpp read no such cap)"
            )
        cap = meta.get(p + "final_logit_softcapping")
        fields["final_logit_softcapping"] = None if cap is None else float(cap)
        local_theta = 10000.0 if local_theta is None else local_theta
        window = int(window) if window else None
        pattern = meta.get(p + "attention.sliding_window_pattern", 6)
        if window is None:
            layer_types = [FULL_ATTENTION] * n
        elif isinstance(pattern, list):
            if len(pattern) != n:
                raise ValueError(f"GGUF {p}attention.sliding_window_pattern has {len(pattern)} entries for {n} layers")
            layer_types = [SLIDING_ATTENTION if bool(s) else FULL_ATTENTION for s in pattern]
        else:  # llama_hparams::set_swa_pattern: period 0 slides everywhere
            period = int(pattern)
            layer_types = [
                SLIDING_ATTENTION if period == 0 or i % period < period - 1 else FULL_ATTENTION for i in range(n)
            ]
    fields["layer_types"] = layer_types
    fields["sliding_window"] = window if SLIDING_ATTENTION in layer_types else None
    fields["rope_local_theta"] = None if local_theta is None else float(local_theta)
    return fields


FAMILY = ConfigFamily(
    architectures=GEMMA_ARCHITECTURES,
    hf_fields=_hf_fields,
    model_types={"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"},
    gguf_architectures={"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"},
    gguf_fields=_gguf_fields,
    refused={
        "Gemma3ForConditionalGeneration": "the vision-language Gemma 3 is not supported; text-only Gemma 3 "
        "checkpoints (Gemma3ForCausalLM, model_type 'gemma3_text', e.g. gemma-3-1b) are",
    },
)
