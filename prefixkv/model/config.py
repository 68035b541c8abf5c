"""Model configuration: one dataclass for every supported decoder architecture."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    # mixture-of-experts families (model/moe.py)
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)

# GGUF `general.architecture` -> HF architecture name.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    # "llama" with expert tensors is Mixtral (from_gguf_metadata)
}

# HF config.json `model_type` -> architecture, for configs without `architectures`
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def check_architecture(name: str) -> str:
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
    sliding_window: int | None = None  # every layer attends to at most this many latest tokens
    # mixture of experts (model/moe.py); num_experts 0: every layer has the dense MLP
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each routed expert's intermediate size
    norm_topk_prob: bool = False  # renormalise the top-k routing probabilities to sum to one
    shared_expert_intermediate_size: int = 0  # 0: no shared expert (Qwen2-MoE has one, gated)
    decoder_sparse_step: int = 1  # layer i is sparse where (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here

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
        # transformers >= 5 keeps rope_theta (and scaling) in `rope_parameters`;
        # older configs have top-level `rope_theta` and `rope_scaling`.
        rope_params = d.get("rope_parameters") or {}
        rope_theta = rope_params.get("rope_theta", d.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling")
        if scaling is None and rope_params:
            scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        n_heads = d["num_attention_heads"]
        qk_norm = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        uniform_window = arch in ("MistralForCausalLM", "MixtralForCausalLM")
        window = d.get("sliding_window") if uniform_window else None
        layer_types = d.get("layer_types") or []
        if (d.get("use_sliding_window") and not uniform_window) or len(set(layer_types)) > 1:
            raise ValueError(
                "sliding-window attention on some layers only (use_sliding_window / mixed "
                "layer_types) is not supported; every layer must attend the same way"
            )
        if arch == "Qwen2ForCausalLM":
            attention_bias = True
        elif arch == "Qwen2MoeForCausalLM":
            attention_bias = bool(d.get("qkv_bias", True))
        else:
            attention_bias = bool(d.get("attention_bias", False))
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
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=qk_norm,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id", []),  # an int or None too: __post_init__ makes it a list
            sliding_window=window,
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
        moe = _gguf_moe_fields(g_arch, meta, tensor_names)
        if g_arch == "llama" and moe:
            arch = "MixtralForCausalLM"  # llama.cpp writes Mixtral as "llama" with expert tensors
        hidden = int(meta[p + "embedding_length"])
        n_heads = int(meta[p + "attention.head_count"])
        n_kv = int(meta.get(p + "attention.head_count_kv", n_heads))
        head_dim = int(meta.get(p + "attention.key_length", hidden // n_heads))
        vocab = meta.get(p + "vocab_size")
        if vocab is None:
            if "tokenizer.ggml.tokens" not in meta:
                raise ValueError(f"GGUF metadata has neither {p}vocab_size nor tokenizer.ggml.tokens")
            vocab = len(meta["tokenizer.ggml.tokens"])
        scaling = None
        stype = meta.get(p + "rope.scaling.type")
        if stype == "linear":
            scaling = {"rope_type": "linear", "factor": float(meta[p + "rope.scaling.factor"])}
        elif stype not in (None, "none"):
            raise ValueError(f"Unsupported GGUF rope scaling type {stype!r}")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            num_hidden_layers=int(meta[p + "block_count"]),
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            intermediate_size=int(meta[p + "feed_forward_length"]),
            rms_norm_eps=float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(meta.get(p + "rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=int(meta.get(p + "context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=[] if eos is None else [int(eos)],
            **moe,
        )


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
