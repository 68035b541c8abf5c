"""Model configuration: one dataclass for every supported decoder architecture, its validation
and what it derives. Each family's readers of config.json and GGUF metadata are in model/configs/."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from .configs.falcon_h1 import MupMultipliers
from .configs.gemma import GEMMA_ARCHITECTURES
from .configs.mamba2 import SSM_NORMS
from .configs.registry import check_architecture, gguf_fields, hf_fields
from .layer_kinds import (
    FULL_ATTENTION,
    HYBRID,
    LAYER_KINDS,
    LINEAR_ATTENTION,
    MAMBA,
    RECURRENT_KINDS,
    SHORT_CONV,
    SLIDING_ATTENTION,
)

_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")
_ORIGINAL_CONTEXT = "original_max_position_embeddings"
_LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", _ORIGINAL_CONTEXT)


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
    #  "original_max_position_embeddings"} /
    # {"rope_type": "yarn", "factor", "original_max_position_embeddings", optional "beta_fast",
    #  "beta_slow", "truncate", "attention_factor", "mscale", "mscale_all_dim"} /
    # {"rope_type": "longrope", "short_factor", "long_factor", "original_max_position_embeddings",
    #  optional "factor", "attention_factor"} (Phi-3: its short factors; `exact_context` below) /
    # {"rope_type": "proportional", "partial_rotary_factor", optional "factor"} (Gemma 4's full
    #  layers: the first share of the frequencies over the whole head, the rest zero)
    rope_scaling: dict[str, Any] | None = None
    # the rotary pairs each head's dimensions 2i and 2i + 1 (GPT-J's, GLM's, Ernie 4.5's), where
    # transformers' Llama pairs i and i + rotary_dim / 2: q and k rows are reordered at load
    # (LlamaModel.load_hf_weights) so that the one rotation serves both
    rope_interleaved: bool = False
    # Llama 4's attention temperature (Ministral 3): queries times 1 + beta ln(1 + floor(position /
    # length)), which is 1 below `length`; not built, so the context stays below it (exact_context)
    query_temperature_length: int = 0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections with biases
    attention_output_bias: bool = False  # the output projection with a bias (Llama / Qwen3 with attention_bias)
    attention_sinks: bool = False  # a learned sink logit per query head joins each softmax (gpt-oss)
    nope_layers: tuple[int, ...] = ()  # layers whose attention has no rotary embedding (SmolLM3's NoPE)
    # Granite's multipliers (model/granite.py): embeddings, each sublayer's output before the
    # residual add, the attention scale (None: head_dim ** -0.5), the logits' divisor
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
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
    # the router: each expert's score a softmax over the logits (Qwen, Mixtral) or its sigmoid
    # (LFM2-MoE, GLM-4.5, MiniMax-M2); the top k chosen by score plus a learned per-expert bias where
    # `router_selection_bias` (the weights stay the scores), among the experts of the
    # `router_topk_groups` best of `router_num_groups` equal groups (a group's worth: its two best
    # scores; GLM-4.5's and DeepSeek-V3's group-limited choice); the renormalised weights' sum plus
    # `router_norm_epsilon`, and the weights times `routed_scaling_factor`. The logits in float32
    # (x and the router's weight cast: GLM-4.5) or the model's dtype; a sigmoid's scores in
    # float32 (MiniMax-M2, GLM-4.5) or the logits' dtype (LFM2-MoE); a softmax's always in float32
    router_scoring: str = "softmax"
    router_selection_bias: bool = False
    router_num_groups: int = 1
    router_topk_groups: int = 1
    router_logits_float32: bool = False
    router_scores_float32: bool = False
    router_norm_epsilon: float = 0.0
    routed_scaling_factor: float = 1.0
    shared_expert_intermediate_size: int = 0  # 0: no shared expert (Qwen2-MoE has one, gated)
    shared_expert_gated: bool = True  # its output times sigmoid(gate(x)) (Qwen2-MoE), or as it is (Granite 4)
    # gpt-oss's experts (model/gpt_oss.py): gate clamped above and up on both sides at the limit,
    # out = (up + 1) * gate * sigmoid(alpha * gate)
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
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
    # the gated short convolution of SHORT_CONV layers (model/lfm2.py): its kernel's length, and
    # whether its projections and convolution have biases
    short_conv_kernel: int = 0
    short_conv_bias: bool = False
    # multi-head latent attention (DeepSeek-V3, model/deepseek.py); mla_kv_lora_rank 0: none. Each
    # token's keys and values come from one latent of mla_kv_lora_rank and one rotary key of
    # mla_qk_rope_head_dim shared by every head; a head's query and key have mla_qk_nope_head_dim +
    # mla_qk_rope_head_dim dimensions, its value mla_v_head_dim; the query goes through a rank of
    # mla_q_lora_rank (0: one projection). The cache holds the latent and the rotary key as one
    # head: head_dim is their sum and num_key_value_heads 1.
    mla_kv_lora_rank: int = 0
    mla_q_lora_rank: int = 0
    mla_qk_nope_head_dim: int = 0
    mla_qk_rope_head_dim: int = 0
    mla_v_head_dim: int = 0
    # Gemma 4 (model/gemma4.py). Its full-attention layers have heads of global_head_dim and
    # global_num_key_value_heads K/V heads (0: head_dim, num_key_value_heads), and where
    # global_values_are_keys no value projection: each value is the key's projection before the
    # key's norm and rotary. The last num_kv_shared_layers layers project no K/V and cache none:
    # each attends over the K/V of the last earlier layer of its kind (kv_source_layer), and its
    # MLP is twice as wide where double_wide_shared_mlp. Per-layer inputs (per_layer_input_size
    # per layer, 0: none) come from an embedding of per_layer_input_vocab_size tokens and a
    # projection of the token's embedding.
    global_head_dim: int = 0
    global_num_key_value_heads: int = 0
    global_values_are_keys: bool = False
    num_kv_shared_layers: int = 0
    double_wide_shared_mlp: bool = False
    per_layer_input_size: int = 0
    per_layer_input_vocab_size: int = 0

    def __post_init__(self) -> None:
        check_architecture(self.architecture)
        self.mlp_only_layers = tuple(int(i) for i in self.mlp_only_layers)
        self.nope_layers = tuple(int(i) for i in self.nope_layers)
        if any(not 0 <= i < self.num_hidden_layers for i in self.nope_layers):
            raise ValueError(f"nope_layers {self.nope_layers} names layers past the {self.num_hidden_layers} there are")
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
        unknown = sorted(set(self.layer_types) - set(LAYER_KINDS))
        if unknown:
            raise ValueError(f"unsupported layer type(s) {unknown}; supported: {', '.join(LAYER_KINDS)}")
        if SLIDING_ATTENTION in self.layer_types and self.sliding_window is None:
            raise ValueError("layer_types names sliding_attention layers but sliding_window is not set")
        if (MAMBA in self.layer_types or HYBRID in self.layer_types) != (self.ssm_state_size > 0):
            raise ValueError("layer_types names mamba or hybrid layers exactly when ssm_state_size is set")
        if (LINEAR_ATTENTION in self.layer_types) != (self.linear_num_value_heads > 0):
            raise ValueError("layer_types names linear_attention layers exactly when linear_num_value_heads is set")
        if (SHORT_CONV in self.layer_types) != (self.short_conv_kernel > 0):
            raise ValueError("layer_types names conv layers exactly when short_conv_kernel is set")
        if self.linear_num_value_heads and (
            not self.linear_num_key_heads or self.linear_num_value_heads % self.linear_num_key_heads
        ):
            raise ValueError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if self.router_scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"router_scoring must be softmax or sigmoid, got {self.router_scoring!r}")
        if self.num_experts and (
            self.router_num_groups < 1
            or self.num_experts % self.router_num_groups
            or not 1 <= self.router_topk_groups <= self.router_num_groups
            or self.num_experts // self.router_num_groups * self.router_topk_groups < self.num_experts_per_tok
            or (self.router_num_groups > 1 and self.num_experts // self.router_num_groups < 2)
        ):
            raise ValueError(
                f"router groups: {self.num_experts} experts in {self.router_num_groups} groups (n_group), the best "
                f"{self.router_topk_groups} of them (topk_group) holding {self.num_experts_per_tok} chosen experts: "
                "the groups must divide the experts, hold at least two each and, those chosen, at least top k"
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
        if self.mla_kv_lora_rank and (
            self.head_dim != self.mla_kv_lora_rank + self.mla_qk_rope_head_dim
            or self.num_key_value_heads != 1
            or min(self.mla_qk_rope_head_dim, self.mla_qk_nope_head_dim, self.mla_v_head_dim) < 1
            or self.mla_qk_rope_head_dim % 2
        ):
            raise ValueError(
                "multi-head latent attention caches one head of the latent and the rotary key: head_dim must be "
                f"kv_lora_rank + qk_rope_head_dim ({self.mla_kv_lora_rank} + {self.mla_qk_rope_head_dim}), got "
                f"{self.head_dim}, num_key_value_heads 1, got {self.num_key_value_heads}, and the head sizes "
                f"positive (qk_nope_head_dim {self.mla_qk_nope_head_dim}, v_head_dim {self.mla_v_head_dim}; "
                "qk_rope_head_dim even)"
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
        self.global_head_dim = self.global_head_dim or self.head_dim
        self.global_num_key_value_heads = self.global_num_key_value_heads or self.num_key_value_heads
        self._check_kv_sharing()
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
            needed = {
                "linear": ("factor",),
                "llama3": _LLAMA3_FIELDS,
                "yarn": ("factor", _ORIGINAL_CONTEXT),
                "longrope": ("short_factor", "long_factor", _ORIGINAL_CONTEXT),
            }
            missing = [k for k in needed.get(rtype, ()) if rs.get(k) is None]
            if missing:
                raise ValueError(f"rope scaling {rtype!r} needs {', '.join(missing)}")
            if rtype == "default":
                self.rope_scaling = None
            else:
                self.rope_scaling = dict(rs, rope_type=rtype)

    def _check_kv_sharing(self) -> None:
        n, shared = self.num_hidden_layers, self.num_kv_shared_layers
        if not 0 <= shared < n:
            raise ValueError(f"num_kv_shared_layers must be in [0, {n}), got {shared}")
        if shared and (self.is_recurrent or self.is_mla):
            raise ValueError("num_kv_shared_layers is a Gemma 4 trait: not with recurrent or latent attention layers")
        kinds = set(self.layer_types[n - shared :]) - set(self.layer_types[: n - shared])
        if kinds:
            raise ValueError(f"KV-shared layers of kind {sorted(kinds)} have no earlier layer of that kind to read")
        if self.num_attention_heads % self.global_num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"global_num_key_value_heads ({self.global_num_key_value_heads})"
            )
        if self.per_layer_input_size and self.per_layer_input_vocab_size < self.vocab_size:
            raise ValueError(
                f"per_layer_input_vocab_size ({self.per_layer_input_vocab_size}) below vocab_size ({self.vocab_size}) "
                "is not supported: every token needs a per-layer embedding"
            )

    def layer_head_dim(self, i: int) -> int:
        """The head size of layer i's attention (Gemma 4's full layers: global_head_dim)."""
        return self.global_head_dim if self.layer_types[i] == FULL_ATTENTION else self.head_dim

    def layer_num_kv_heads(self, i: int) -> int:
        """The K/V heads of layer i's attention (Gemma 4's full layers: global_num_key_value_heads)."""
        return self.global_num_key_value_heads if self.layer_types[i] == FULL_ATTENTION else self.num_key_value_heads

    def kv_source_layer(self, i: int) -> int:
        """The layer whose K/V layer i attends over: its own, or for one of the last
        num_kv_shared_layers the last layer of its kind before them (transformers' Gemma 4)."""
        first_shared = self.num_hidden_layers - self.num_kv_shared_layers
        if i < first_shared:
            return i
        return max(j for j in range(first_shared) if self.layer_types[j] == self.layer_types[i])

    @property
    def uniform_kv_layers(self) -> bool:
        """Whether every attention layer caches its own K/V, all in one shape (what KV-cache groups
        and the fused decode kernel take)."""
        n = self.num_hidden_layers
        shapes = {(self.layer_head_dim(i), self.layer_num_kv_heads(i)) for i in range(n) if self.is_attention_layer(i)}
        return not self.num_kv_shared_layers and len(shapes) <= 1

    @property
    def exact_context(self) -> int | None:
        """The longest context whose outputs are the reference's, where a model has one
        (`exact_context_bound`)."""
        bound = self.exact_context_bound
        return None if bound is None else bound[0]

    @property
    def exact_context_bound(self) -> tuple[int, str, str] | None:
        """(length, what bounds it, why), where a model's outputs are the reference's only below a
        length: LongRoPE rotates by its short factors up to `original_max_position_embeddings` and,
        in transformers, by its long ones for every position once a sequence is longer - which
        would change the rotation of keys already cached; prefixkv builds the short ones only.
        Llama 4's query temperature is 1 below its length, and is not built."""
        rs = self.rope_scaling
        if rs is not None and rs["rope_type"] == "longrope":
            return (
                int(rs["original_max_position_embeddings"]),
                "LongRoPE original context",
                "its long factors, which transformers switches every position to for a longer sequence, are not built",
            )
        if self.query_temperature_length:
            return (
                self.query_temperature_length,
                "attention temperature's length",
                "Llama 4's query scaling, 1 below it, is not built",
            )
        return None

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
        Mamba2, the Mamba layers of a hybrid, Qwen3-Next's linear attention layers, LFM2's
        convolutions)."""
        return self.ssm_state_size > 0 or self.linear_num_value_heads > 0 or self.short_conv_kernel > 0

    @property
    def recurrent_conv_kernel(self) -> int:
        """The length of the causal conv kernel every recurrent layer runs (Mamba2's, the gated
        delta net's or the short convolution's), which a step's fixed conv windows are sized by
        (static_scan.py); 0 without recurrent layers."""
        kernels = {
            self.ssm_conv_kernel if kind in (MAMBA, HYBRID) else self.linear_conv_kernel if kind == LINEAR_ATTENTION
            else self.short_conv_kernel
            for kind in self.layer_types
            if kind in RECURRENT_KINDS
        }  # fmt: skip
        if len(kernels) > 1:
            raise ValueError(f"recurrent layers with conv kernels of {sorted(kernels)}: one length is supported")
        return kernels.pop() if kernels else 0

    def is_recurrent_layer(self, i: int) -> bool:
        """Whether decoder layer i has a Mamba2 mixer, a gated delta net or a short convolution (a
        state per block)."""
        return self.layer_types[i] in RECURRENT_KINDS

    def is_attention_layer(self, i: int) -> bool:
        """Whether decoder layer i has attention (K/V rows per block)."""
        return self.layer_types[i] not in (MAMBA, LINEAR_ATTENTION, SHORT_CONV)

    @property
    def is_mla(self) -> bool:
        """Whether attention is multi-head latent attention (its cache: one latent head a token)."""
        return self.mla_kv_lora_rank > 0

    @property
    def rotary_dim(self) -> int:
        """How many of each attention head's dimensions rotary rotates (the first ones)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, i: int) -> bool:
        """Whether decoder layer i has routed experts (transformers' Qwen2/3-MoE rule; every layer
        of Mixtral)."""
        return bool(self.num_experts) and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """From config.json's contents, read by its family's reader (model/configs/)."""
        return cls(**hf_fields(d))

    @classmethod
    def from_hf_folder(cls, folder: str) -> ModelConfig:
        path = os.path.join(folder, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"No config.json in model folder {folder!r}")
        with open(path, encoding="utf-8") as f:
            return cls.from_hf_dict(json.load(f))

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
        """From a GGUF file's metadata and tensor names, read by its family's reader (model/configs/)."""
        return cls(**gguf_fields(meta, tensor_names))
