"""Model configuration: one dataclass for every supported decoder architecture."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, cast

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    # mixture-of-experts families (model/moe.py)
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    # recurrent: a state-space mixer in every layer (model/mamba2.py)
    "Mamba2ForCausalLM",
    # hybrids of Mamba2 and attention (model/hybrid.py): layers of either kind (Bamba), both in
    # every layer side by side (Falcon-H1, model/falcon_h1.py)
    "BambaForCausalLM",
    "FalconH1ForCausalLM",
    # gated delta net (linear attention) layers and gated full attention, MoE MLPs
    # (model/qwen3_next.py)
    "Qwen3NextForCausalLM",
)

# The Gemma family's block (model/gemma.py): sandwich norms, GeGLU, scaled embeddings, soft-capping.
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")

# HF `model_type` -> architecture, for a config.json without `architectures`.
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mamba2": "Mamba2ForCausalLM",
    "bamba": "BambaForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
}

# Architectures refused with a reason of their own (a near miss of a supported one).
_REFUSED = {
    "Gemma3ForConditionalGeneration": "the vision-language Gemma 3 is not supported; text-only Gemma 3 "
    "checkpoints (Gemma3ForCausalLM, model_type 'gemma3_text', e.g. gemma-3-1b) are",
}

# The layer kinds of `ModelConfig.layer_types`: two attention kinds, with HF's names; a recurrent
# (Mamba2 mixer) layer, which keeps a state per block in place of K/V rows; and a layer with both a
# Mamba2 mixer and full attention side by side, keeping both (HF's Falcon-H1 name).
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
MAMBA = "mamba"
HYBRID = "hybrid"
# a gated delta net layer (Qwen3-Next's linear attention): a recurrent state per block, as MAMBA
LINEAR_ATTENTION = "linear_attention"
_LAYER_KINDS = (FULL_ATTENTION, SLIDING_ATTENTION, MAMBA, HYBRID, LINEAR_ATTENTION)
_RECURRENT_KINDS = (MAMBA, HYBRID, LINEAR_ATTENTION)

# How the Mamba2 mixer gates its scan output y with silu(gate) before out_proj: gated then the
# group RMS norm (Mamba2, Bamba; Falcon-H1 with mamba_norm_before_gate false), the norm then gated
# (Falcon-H1's default where mamba_rms_norm), or gated without a norm (Falcon-H1 without it).
SSM_NORMS = ("gate_then_norm", "norm_then_gate", "none")


@dataclass(frozen=True)
class MupMultipliers:
    """Falcon-H1's muP scalars (1: none). The model folds each into a weight at load, but the
    logits' where the head is tied (it shares the embedding's weight)."""

    embedding: float = 1.0  # the input embeddings
    lm_head: float = 1.0  # the logits
    attention_in: float = 1.0  # attention's input (q, k, v)
    key: float = 1.0  # k, before rotary
    attention_out: float = 1.0  # o_proj's output
    ssm_in: float = 1.0  # the mixer's input
    ssm_out: float = 1.0  # the mixer's output
    # the mixer's in_proj output, by part: gate, x, B, C, dt
    ssm_parts: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)
    mlp_gate: float = 1.0  # the MLP's gate projection, before the activation
    mlp_down: float = 1.0  # the MLP's output


# GGUF `general.architecture` -> HF architecture name.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    # "llama" with expert tensors is Mixtral (from_gguf_metadata)
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "mamba2": "Mamba2ForCausalLM",
}

_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def check_architecture(name: str) -> str:
    if name in _REFUSED:
        raise ValueError(f"Unsupported model architecture {name!r}: {_REFUSED[name]}")
    if name not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"Unsupported model architecture {name!r}; supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return name


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None / {"rope_type": "default"} / {"rope_type": "linear", "factor": f} /
    # {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    #  "original_max_position_embeddings"}
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    sliding_window: int | None = None  # a sliding layer attends to at most this many latest tokens
    # per layer FULL_ATTENTION or SLIDING_ATTENTION; empty: every layer slides where sliding_window
    # is set (Mistral), else none does
    layer_types: list[str] = field(default_factory=list)
    # the Gemma family's traits (None / defaults: absent)
    query_pre_attn_scalar: float | None = None  # attention scale query_pre_attn_scalar**-0.5
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    rope_local_theta: float | None = None  # sliding layers' rotary base, unscaled (Gemma 3); None: rope_theta
    hidden_activation: str = "silu"  # the gated MLP's activation: "silu" or "gelu_pytorch_tanh"
    # mixture of experts (model/moe.py); num_experts 0: every layer has the dense MLP
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each routed expert's intermediate size
    norm_topk_prob: bool = False  # renormalise the top-k routing probabilities to sum to one
    shared_expert_intermediate_size: int = 0  # 0: no shared expert (Qwen2-MoE has one, gated)
    decoder_sparse_step: int = 1  # layer i is sparse where (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    # Mamba2's state-space mixer (model/mamba2.py); ssm_state_size 0: no recurrent layer. Its heads
    # are ssm_num_heads x ssm_head_dim (= ssm_intermediate_size), its B/C groups ssm_n_groups; 0
    # takes num_attention_heads, head_dim and intermediate_size (a pure Mamba2 model's).
    ssm_state_size: int = 0
    ssm_num_heads: int = 0
    ssm_head_dim: int = 0
    ssm_intermediate_size: int = 0
    ssm_n_groups: int = 1
    ssm_conv_kernel: int = 4
    ssm_use_conv_bias: bool = True
    ssm_use_bias: bool = False  # in_proj / out_proj biases
    ssm_time_step_limit: tuple[float, float] = (0.0, float("inf"))  # dt clamped into it
    ssm_norm: str = "gate_then_norm"  # one of SSM_NORMS
    residual_in_fp32: bool = False  # the residual stream kept in float32
    # the share of each attention head's dimensions that rotary rotates (the first ones; Bamba: 0.5)
    partial_rotary_factor: float = 1.0
    mup: MupMultipliers = field(default_factory=MupMultipliers)
    # the gated delta net of LINEAR_ATTENTION layers (model/gated_delta.py): q/k heads of
    # linear_key_head_dim, v heads of linear_value_head_dim (a multiple of the q/k heads), a causal
    # conv of linear_conv_kernel over q, k and v
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 4

    def __post_init__(self) -> None:
        check_architecture(self.architecture)
        self.mlp_only_layers = tuple(int(i) for i in self.mlp_only_layers)
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok must be between 1 and num_experts ({self.num_experts}), "
                    f"got {self.num_experts_per_tok!r}"
                )
            if self.moe_intermediate_size < 1 or self.decoder_sparse_step < 1:
                raise ValueError(
                    "a mixture-of-experts config needs moe_intermediate_size >= 1 and decoder_sparse_step >= 1, "
                    f"got {self.moe_intermediate_size!r} and {self.decoder_sparse_step!r}"
                )
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive integer or None, got {self.sliding_window!r}")
        if not self.layer_types:
            if self.ssm_state_size:  # a pure state-space model: every layer recurrent
                kind = MAMBA
            else:
                kind = SLIDING_ATTENTION if self.sliding_window is not None else FULL_ATTENTION
            self.layer_types = [kind] * self.num_hidden_layers
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} hidden layers"
            )
        unknown = sorted(set(self.layer_types) - set(_LAYER_KINDS))
        if unknown:
            raise ValueError(f"unsupported layer type(s) {unknown}; supported: {', '.join(_LAYER_KINDS)}")
        if SLIDING_ATTENTION in self.layer_types and self.sliding_window is None:
            raise ValueError("layer_types names sliding_attention layers but sliding_window is not set")
        if (MAMBA in self.layer_types or HYBRID in self.layer_types) != (self.ssm_state_size > 0):
            raise ValueError("layer_types names mamba or hybrid layers exactly when ssm_state_size is set")
        if (LINEAR_ATTENTION in self.layer_types) != (self.linear_num_value_heads > 0):
            raise ValueError("layer_types names linear_attention layers exactly when linear_num_value_heads is set")
        if self.linear_num_value_heads and (
            not self.linear_num_key_heads or self.linear_num_value_heads % self.linear_num_key_heads
        ):
            raise ValueError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if self.ssm_norm not in SSM_NORMS:
            raise ValueError(f"ssm_norm must be one of {SSM_NORMS}, got {self.ssm_norm!r}")
        if self.ssm_state_size:
            self.ssm_num_heads = self.ssm_num_heads or self.num_attention_heads
            self.ssm_head_dim = self.ssm_head_dim or self.head_dim or self.hidden_size // self.num_attention_heads
            self.ssm_intermediate_size = self.ssm_intermediate_size or self.intermediate_size
            if self.ssm_num_heads * self.ssm_head_dim != self.ssm_intermediate_size:
                raise ValueError(
                    f"the Mamba2 mixer's heads x head_dim ({self.ssm_num_heads} x {self.ssm_head_dim}) must equal "
                    f"its intermediate size ({self.ssm_intermediate_size})"
                )
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor!r}")
        if self.hidden_activation not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(
                f"unsupported hidden_activation {self.hidden_activation!r}; supported: 'silu', 'gelu_pytorch_tanh'"
            )
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive or None, got {value!r}")
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if isinstance(self.eos_token_id, int):
            self.eos_token_id = [self.eos_token_id]
        elif self.eos_token_id is None:
            self.eos_token_id = []
        else:
            self.eos_token_id = [int(x) for x in self.eos_token_id]
        rs = self.rope_scaling
        if rs is not None:
            rtype = rs.get("rope_type", rs.get("type", "default"))
            if rtype not in _SUPPORTED_ROPE_TYPES:
                raise ValueError(f"Unsupported rope scaling type {rtype!r}; supported: {_SUPPORTED_ROPE_TYPES}")
            if rtype == "default":
                self.rope_scaling = None
            else:
                self.rope_scaling = dict(rs, rope_type=rtype)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def layer_windows(self) -> list[int | None]:
        """Per layer, the window it attends within (None: the whole context)."""
        return [self.sliding_window if t == SLIDING_ATTENTION else None for t in self.layer_types]

    @property
    def any_sliding(self) -> bool:
        """Whether some layer attends within a window."""
        return SLIDING_ATTENTION in self.layer_types

    @property
    def is_gemma(self) -> bool:
        return self.architecture in GEMMA_ARCHITECTURES

    @property
    def is_recurrent(self) -> bool:
        """Whether some layer keeps a recurrent state per block instead of K/V rows (every layer of
        Mamba2, the Mamba layers of a hybrid, Qwen3-Next's linear attention layers)."""
        return self.ssm_state_size > 0 or self.linear_num_value_heads > 0

    def is_recurrent_layer(self, i: int) -> bool:
        """Whether decoder layer i has a Mamba2 mixer or a gated delta net (a state per block)."""
        return self.layer_types[i] in _RECURRENT_KINDS

    def is_attention_layer(self, i: int) -> bool:
        """Whether decoder layer i has attention (K/V rows per block)."""
        return self.layer_types[i] not in (MAMBA, LINEAR_ATTENTION)

    @property
    def rotary_dim(self) -> int:
        """How many of each attention head's dimensions rotary rotates (the first ones)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, i: int) -> bool:
        """Whether decoder layer i has routed experts (transformers' Qwen2/3-MoE rule; every layer
        of Mixtral)."""
        return bool(self.num_experts) and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    # ------------------------------------------------------------------ HF
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        archs = d.get("architectures") or []
        if not archs:
            mt: Any = d.get("model_type")  # whatever config.json holds, named in the error
            archs = [_MODEL_TYPES.get(mt, f"<model_type {mt!r}>")]
        arch = check_architecture(archs[0])
        if arch == "Mamba2ForCausalLM":
            return cls(**_hf_mamba2_fields(d))
        if arch == "BambaForCausalLM":
            return cls(**_hf_bamba_fields(d))
        if arch == "FalconH1ForCausalLM":
            return cls(**_hf_falcon_h1_fields(d))
        if arch == "Qwen3NextForCausalLM":
            return cls(**_hf_qwen3_next_fields(d))
        gemma = arch in GEMMA_ARCHITECTURES
        rope_theta, scaling, local_theta = _rope_settings(d, arch)
        n_heads = d["num_attention_heads"]
        window, layer_types = _attention_layers(d, arch)
        if arch == "Qwen2ForCausalLM":
            attention_bias = True
        elif arch == "Qwen2MoeForCausalLM":
            attention_bias = bool(d.get("qkv_bias", True))
        else:
            attention_bias = bool(d.get("attention_bias", False))
        extra: dict[str, Any] = {}
        if gemma:
            if attention_bias:
                raise ValueError(f"{arch} with attention_bias=true is not supported")
            if d.get("use_bidirectional_attention"):
                raise ValueError(f"{arch} with use_bidirectional_attention=true (an embedding model) is not supported")
            extra = dict(
                query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)),
                # transformers' Gemma 3 reads no attention soft-capping (its config key is unused)
                attn_logit_softcapping=(d.get("attn_logit_softcapping", 50.0) if arch == "Gemma2ForCausalLM" else None),
                final_logit_softcapping=d.get("final_logit_softcapping", 30.0 if arch == "Gemma2ForCausalLM" else None),
                rope_local_theta=local_theta,
                hidden_activation=d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh",
            )
        elif d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{arch} with hidden_act={d.get('hidden_act')!r} is not supported (silu only)")
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=d.get("num_key_value_heads") or n_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // n_heads,
            intermediate_size=d["intermediate_size"],
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", gemma)),
            attention_bias=attention_bias,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id", []),  # an int or None too: __post_init__ makes it a list
            sliding_window=window,
            layer_types=layer_types,
            **extra,
            **_hf_moe_fields(arch, d),
        )

    @classmethod
    def from_hf_folder(cls, folder: str) -> ModelConfig:
        path = os.path.join(folder, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"No config.json in model folder {folder!r}")
        with open(path, encoding="utf-8") as f:
            return cls.from_hf_dict(json.load(f))

    # ---------------------------------------------------------------- GGUF
    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
        g_arch = meta.get("general.architecture")
        if g_arch not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"Unsupported GGUF architecture {g_arch!r}; supported GGUF architectures: "
                f"{', '.join(GGUF_ARCHITECTURES)} (HF: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        arch = GGUF_ARCHITECTURES[g_arch]
        p = g_arch + "."
        vocab = meta.get(p + "vocab_size")
        if vocab is None:
            if "tokenizer.ggml.tokens" not in meta:
                raise ValueError(f"GGUF metadata has neither {p}vocab_size nor tokenizer.ggml.tokens")
            vocab = len(meta["tokenizer.ggml.tokens"])
        eos = meta.get("tokenizer.ggml.eos_token_id")
        common: dict[str, Any] = dict(
            vocab_size=int(vocab),
            num_hidden_layers=int(meta[p + "block_count"]),
            tie_word_embeddings="output.weight" not in tensor_names,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=[] if eos is None else [int(eos)],
        )
        if g_arch == "mamba2":
            return cls(**common, **_gguf_mamba2_fields(meta, tensor_names))
        moe = _gguf_moe_fields(g_arch, meta, tensor_names)
        if g_arch == "llama" and moe:
            arch = "MixtralForCausalLM"  # llama.cpp writes Mixtral as "llama" with expert tensors
        hidden = int(meta[p + "embedding_length"])
        n_heads = int(meta[p + "attention.head_count"])
        n_kv = int(meta.get(p + "attention.head_count_kv", n_heads))
        head_dim = int(meta.get(p + "attention.key_length", hidden // n_heads))
        value_length = int(meta.get(p + "attention.value_length", head_dim))
        if value_length != head_dim:
            raise ValueError(
                f"GGUF {p}attention.value_length ({value_length}) != {p}attention.key_length ({head_dim}) "
                "is not supported"
            )
        rope_dims = meta.get(p + "rope.dimension_count")
        if rope_dims is not None and int(rope_dims) != head_dim:
            raise ValueError(
                f"GGUF {p}rope.dimension_count ({rope_dims}) != the head dimension ({head_dim}): partial "
                "rotary embeddings are not supported"
            )
        scaling = None
        stype = meta.get(p + "rope.scaling.type")
        if stype == "linear":
            scaling = {"rope_type": "linear", "factor": float(meta[p + "rope.scaling.factor"])}
        elif stype not in (None, "none"):
            raise ValueError(f"Unsupported GGUF rope scaling type {stype!r}")
        gemma: dict[str, Any] = {}
        if arch in GEMMA_ARCHITECTURES:
            if "blk.0.attn_q.bias" in tensor_names:
                raise ValueError(f"GGUF {g_arch!r} with attention biases is not supported")
            if p + "attention.layer_norm_rms_epsilon" not in meta:  # llama.cpp requires it too
                raise ValueError(f"GGUF metadata misses {p}attention.layer_norm_rms_epsilon")
            if (g_arch == "gemma3") != ("blk.0.attn_q_norm.weight" in tensor_names):
                raise ValueError(
                    f"GGUF {g_arch!r} {'without' if g_arch == 'gemma3' else 'with'} Q/K norms is not supported"
                )
            gemma = _gguf_gemma_fields(g_arch, meta, hidden, n_heads, head_dim)
        return cls(
            architecture=arch,
            hidden_size=hidden,
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            intermediate_size=int(meta[p + "feed_forward_length"]),
            rms_norm_eps=float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(meta.get(p + "rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=int(meta.get(p + "context_length", 2048)),
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            **common,
            **moe,
            **gemma,
        )


def _rope_settings(d: dict[str, Any], arch: str) -> tuple[float, dict[str, Any] | None, float | None]:
    """(rotary base, scaling or None, the sliding layers' own base or None) from an HF config.
    transformers >= 5 keeps them in `rope_parameters` - per layer type for Gemma 3 - and older
    configs at the top level (`rope_theta`, `rope_scaling`, Gemma 3's `rope_local_base_freq`)."""
    gemma3 = arch == "Gemma3ForCausalLM"
    rope_params = d.get("rope_parameters") or {}
    local: dict[str, Any] = {}
    if FULL_ATTENTION in rope_params or SLIDING_ATTENTION in rope_params:
        local = rope_params.get(SLIDING_ATTENTION) or {}
        rope_params = rope_params.get(FULL_ATTENTION) or {}
    default_theta = 1_000_000.0 if gemma3 else 10000.0
    rope_theta = rope_params.get("rope_theta", d.get("rope_theta", default_theta))
    scaling = d.get("rope_scaling")
    if scaling is None and rope_params:
        scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    local_theta = None
    if gemma3:
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"Gemma 3's sliding layers with rope type {local['rope_type']!r} are not supported")
        local_theta = float(local.get("rope_theta", d.get("rope_local_base_freq", 10000.0)))
    return float(rope_theta), scaling, local_theta


def _attention_layers(d: dict[str, Any], arch: str) -> tuple[int | None, list[str]]:
    """(window, per-layer attention kinds) from an HF config, as transformers reads them: Mistral
    slides on every layer; Qwen2 / Qwen3 with `use_sliding_window` from layer `max_window_layers`
    on; Gemma 2 on every other layer from the first; Gemma 3 on all but every
    `sliding_window_pattern`-th; an explicit `layer_types` list wins everywhere."""
    n = d["num_hidden_layers"]
    layer_types = list(d.get("layer_types") or [])
    window = d.get("sliding_window")
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        if layer_types and set(layer_types) != {SLIDING_ATTENTION if window else FULL_ATTENTION}:
            raise ValueError(f"{arch} with mixed layer_types is not supported")
        return window, []
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        if (d.get("use_sliding_window") and window is not None) or SLIDING_ATTENTION in layer_types:
            raise ValueError(f"{arch} with sliding-window layers is not supported")
        return None, []
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        window = window if d.get("use_sliding_window") else None
        if not layer_types:
            first = d.get("max_window_layers", n)
            layer_types = [SLIDING_ATTENTION if window is not None and i >= first else FULL_ATTENTION for i in range(n)]
    elif arch == "Gemma2ForCausalLM":
        window = window if window is not None else 4096
        layer_types = layer_types or [SLIDING_ATTENTION if (i + 1) % 2 else FULL_ATTENTION for i in range(n)]
    elif arch == "Gemma3ForCausalLM":
        window = window if window is not None else 4096
        pattern = d.get("sliding_window_pattern", 6)
        layer_types = layer_types or [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(n)]
    else:  # Llama has no window (transformers ignores the key)
        if SLIDING_ATTENTION in layer_types:
            raise ValueError(f"{arch} with sliding_attention layers is not supported")
        return None, []
    if SLIDING_ATTENTION not in layer_types:
        return None, layer_types
    return window, layer_types


def _hf_moe_fields(arch: str, d: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of an HF config (none for a dense architecture). transformers
    5 writes Qwen3-MoE's expert count as `num_local_experts`, the published checkpoints as
    `num_experts`: either is read."""
    if arch == "MixtralForCausalLM":
        return {
            "num_experts": int(d.get("num_local_experts") or d.get("num_experts") or 0),
            "num_experts_per_tok": int(d.get("num_experts_per_tok", 2)),
            "moe_intermediate_size": int(d["intermediate_size"]),
            "norm_topk_prob": True,  # Mixtral always renormalises its top-k
        }
    if arch not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return {}
    fields = {
        "num_experts": int(d.get("num_experts") or d.get("num_local_experts") or 0),
        "num_experts_per_tok": int(d.get("num_experts_per_tok", 0)),
        "moe_intermediate_size": int(d.get("moe_intermediate_size", 0)),
        "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
        "decoder_sparse_step": int(d.get("decoder_sparse_step", 1)),
        "mlp_only_layers": tuple(d.get("mlp_only_layers") or ()),
    }
    if arch == "Qwen2MoeForCausalLM":
        fields["shared_expert_intermediate_size"] = int(d.get("shared_expert_intermediate_size", 0))
    return fields


def _gguf_moe_fields(g_arch: str, meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """The mixture-of-experts fields of a GGUF file's metadata, as llama.cpp reads them: the top-k
    weights renormalised for Mixtral ("llama") and Qwen3-MoE, not for Qwen2-MoE, unless the file
    says (`expert_weights_norm`)."""
    p = g_arch + "."
    experts = int(meta.get(p + "expert_count", 0) or 0)
    if not experts:
        if g_arch in ("qwen2moe", "qwen3moe"):
            raise ValueError(f"GGUF architecture {g_arch!r} without {p}expert_count")
        return {}
    norm = meta.get(p + "expert_weights_norm")
    if norm is None:
        norm = g_arch != "qwen2moe"
    gating = meta.get(p + "expert_gating_func")
    if gating not in (None, 1):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise ValueError(f"GGUF {p}expert_gating_func={gating!r} is not supported (only softmax routing)")
    fields: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": int(meta.get(p + "expert_used_count", 0)),
        "moe_intermediate_size": int(meta.get(p + "expert_feed_forward_length") or meta[p + "feed_forward_length"]),
        "norm_topk_prob": bool(norm),
    }
    # which layers are dense: those without a router tensor
    blocks = int(meta[p + "block_count"])
    dense = tuple(i for i in range(blocks) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names)
    fields["mlp_only_layers"] = dense
    if g_arch == "qwen2moe":
        fields["shared_expert_intermediate_size"] = int(meta.get(p + "expert_shared_feed_forward_length", 0))
    return fields


def _hf_mamba2_fields(d: dict[str, Any]) -> dict[str, Any]:
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
        ssm_state_size=int(d.get("state_size", 128)),
        ssm_n_groups=groups,
        ssm_conv_kernel=int(d.get("conv_kernel", 4)),
        ssm_use_conv_bias=bool(d.get("use_conv_bias", True)),
        ssm_use_bias=bool(d.get("use_bias", False)),
        ssm_time_step_limit=(_json_float(limit[0]), _json_float(limit[1])),
        residual_in_fp32=bool(d.get("residual_in_fp32", True)),
    )


def _json_float(v: Any) -> float:
    """A float from config.json, where transformers 5 writes infinity as {"__float__": "Infinity"}."""
    return float(v["__float__"] if isinstance(v, dict) else v)


# llama.cpp's layer counts of the Gemma 27B models, whose attention scale is 1/sqrt(hidden / heads)
# (src/llama-model.cpp; every other size: 1/sqrt(head_dim)). The file carries no scale of its own.
_GGUF_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


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


def _gguf_mamba2_fields(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
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
        ssm_state_size=int(meta[p + "ssm.state_size"]),
        ssm_n_groups=groups,
        ssm_conv_kernel=int(meta[p + "ssm.conv_kernel"]),
        ssm_use_conv_bias="blk.0.ssm_conv1d.bias" in tensor_names,
        ssm_use_bias=False,
        residual_in_fp32=True,
    )


def _hf_mamba2_hybrid_fields(
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
    rope_theta, scaling, _ = _rope_settings(d, arch)
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
        ssm_time_step_limit=(_json_float(limit[0]), _json_float(limit[1])),
    )


def _hf_bamba_fields(d: dict[str, Any]) -> dict[str, Any]:
    """A Bamba config.json (transformers' BambaConfig names and defaults) as ModelConfig fields:
    Mamba2 layers, attention (Llama's, GQA, rotary on half of each head) at `attn_layer_indices`,
    a SwiGLU MLP after either."""
    arch = "BambaForCausalLM"
    ssm_intermediate = int(d.get("mamba_expand", 2) * int(d.get("hidden_size", 4096)))
    fields = _hf_mamba2_hybrid_fields(d, arch, ssm_intermediate, ())
    n_layers = fields["num_hidden_layers"]
    attn = {int(i) for i in d.get("attn_layer_indices") or ()}
    if not attn <= set(range(n_layers)):
        raise ValueError(f"{arch} attn_layer_indices {sorted(attn)} outside its {n_layers} layers")
    fields.update(
        # transformers' BambaConfig takes 0.5 where rope_parameters does not say
        partial_rotary_factor=float((d.get("rope_parameters") or {}).get("partial_rotary_factor", 0.5)),
        max_position_embeddings=int(d.get("max_position_embeddings", 262144)),
        layer_types=[FULL_ATTENTION if i in attn else MAMBA for i in range(n_layers)],
        ssm_use_bias=bool(d.get("mamba_proj_bias", False)),
    )
    if len(attn) == n_layers:  # attention in every layer: no mixer, no state
        fields["ssm_state_size"] = 0
    return fields


def _hf_falcon_h1_fields(d: dict[str, Any]) -> dict[str, Any]:
    """A Falcon-H1 config.json (transformers' FalconH1Config names and defaults) as ModelConfig
    fields: a Mamba2 mixer and attention side by side in every layer, a SwiGLU MLP after, muP
    multipliers throughout."""
    arch = "FalconH1ForCausalLM"
    d_ssm = d.get("mamba_d_ssm", 1024)
    ssm_intermediate = int(d.get("mamba_expand", 2) * int(d.get("hidden_size", 4096))) if d_ssm is None else int(d_ssm)
    fields = _hf_mamba2_hybrid_fields(
        d, arch, ssm_intermediate, (("projectors_bias", False), ("mamba_proj_bias", False))
    )
    if not d.get("mamba_rms_norm", False):
        ssm_norm = "none"
    else:
        ssm_norm = "norm_then_gate" if d.get("mamba_norm_before_gate", True) else "gate_then_norm"
    mlp = d.get("mlp_multipliers") or (1.0, 1.0)
    ssm_parts = d.get("ssm_multipliers") or (1.0,) * 5
    if len(mlp) != 2 or len(ssm_parts) != 5:
        raise ValueError(f"{arch} needs 2 mlp_multipliers and 5 ssm_multipliers, got {mlp!r} and {ssm_parts!r}")

    def scalar(key: str) -> float:
        value = d.get(key)
        return 1.0 if value is None else float(value)

    mup = MupMultipliers(
        embedding=scalar("embedding_multiplier"),
        lm_head=scalar("lm_head_multiplier"),
        attention_in=scalar("attention_in_multiplier"),
        key=scalar("key_multiplier"),
        attention_out=scalar("attention_out_multiplier"),
        ssm_in=scalar("ssm_in_multiplier"),
        ssm_out=scalar("ssm_out_multiplier"),
        ssm_parts=cast(tuple[float, float, float, float, float], tuple(float(m) for m in ssm_parts)),
        mlp_gate=float(mlp[0]),
        mlp_down=float(mlp[1]),
    )
    if mup.embedding == 0:
        raise ValueError(f"{arch} with embedding_multiplier 0 is not supported")
    fields.update(
        partial_rotary_factor=float((d.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)),
        max_position_embeddings=int(d.get("max_position_embeddings", 8192)),
        layer_types=[HYBRID] * fields["num_hidden_layers"],
        ssm_norm=ssm_norm,
        mup=mup,
    )
    return fields


def _hf_qwen3_next_fields(d: dict[str, Any]) -> dict[str, Any]:
    """A Qwen3-Next config.json (transformers' Qwen3NextConfig names and defaults) as ModelConfig
    fields: gated delta net layers and gated full attention layers (q/k norm, rotary over the first
    quarter of each head), a mixture-of-experts MLP with a gated shared expert where
    `decoder_sparse_step` / `mlp_only_layers` say, a dense one elsewhere."""
    arch = "Qwen3NextForCausalLM"
    hidden = int(d.get("hidden_size", 2048))
    n_layers = int(d.get("num_hidden_layers", 48))
    n_heads = int(d.get("num_attention_heads", 16))
    for key, supported in (("hidden_act", "silu"), ("attention_bias", False)):
        if d.get(key, supported) != supported:
            raise ValueError(f"{arch} with {key}={d.get(key)!r} is not supported ({supported!r} only)")
    layer_types = list(d.get("layer_types") or [])
    if not layer_types:
        interval = int(d.get("full_attention_interval", 4))
        layer_types = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(n_layers)]
    unknown = sorted(set(layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION})
    if unknown:
        raise ValueError(f"{arch} with layer type(s) {unknown} is not supported (linear_attention, full_attention)")
    rope_theta, scaling, _ = _rope_settings(d, arch)
    if scaling is not None:
        raise ValueError(f"{arch} with rope scaling {scaling!r} is not supported")
    rope_params = d.get("rope_parameters") or {}
    # transformers' Qwen3NextConfig takes 0.25 where neither place says
    partial = rope_params.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))
    num_experts = int(d.get("num_experts", 512))
    return dict(
        architecture=arch,
        vocab_size=int(d.get("vocab_size", 151936)),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=int(d.get("num_key_value_heads") or 2),
        head_dim=int(d.get("head_dim") or 256),
        intermediate_size=int(d.get("intermediate_size", 5632)),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        partial_rotary_factor=float(partial),
        max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qk_norm=True,
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id", []),
        layer_types=layer_types,
        num_experts=num_experts,
        num_experts_per_tok=int(d.get("num_experts_per_tok", 10)) if num_experts else 0,
        moe_intermediate_size=int(d.get("moe_intermediate_size", 512)) if num_experts else 0,
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size", 512)) if num_experts else 0,
        decoder_sparse_step=int(d.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()),
        linear_num_key_heads=int(d.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(d.get("linear_num_value_heads", 32)) if LINEAR_ATTENTION in layer_types else 0,
        linear_key_head_dim=int(d.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(d.get("linear_value_head_dim", 128)),
        linear_conv_kernel=int(d.get("linear_conv_kernel_dim", 4)),
    )
