"""The Gemma 4 decoder (text): Gemma's sandwich-normed block and GeGLU with

- plain RMSNorms (x / rms(x) * w, in float32) and q, k and v each normed per head (v without a
  weight), the scores unscaled;
- full-attention layers with heads of their own size and K/V heads (`global_head_dim`), rotated by
  the proportional rotary (the first quarter of the frequencies over the whole head), and where
  `global_values_are_keys` no value projection (each value is the key's projection);
- the last `num_kv_shared_layers` layers projecting no K/V: each attends over the K/V of the last
  earlier layer of its kind (ModelConfig.kv_source_layer), read from that layer's cache and, for
  this step's tokens, handed over within the forward; their MLPs twice as wide where the config
  says so;
- per-layer inputs: an embedding of each token per layer plus a projection of its embedding,
  gated into the residual stream after each layer's MLP;
- each layer's output scaled by its `layer_scalar`, and the logits soft-capped;
- in the mixture-of-experts release (26B-A4B), routed experts beside every layer's dense MLP,
  each normed apart and their outputs added (Gemma4MoeMLP, Gemma4Router).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import sdpa_kernel

from .attention import AttentionMetadata, paged_attention
from .config import ModelConfig
from .configs.gemma4 import GEMMA4_ARCHITECTURES
from .empty_weights import materialize
from .layer_kinds import FULL_ATTENTION
from .layers import Float32RMSNorm, GatedMLP, RMSNorm, RotaryEmbedding, keep_float32_norms
from .llama import CUDA_ATTENTION_BACKENDS, LlamaModel
from .moe import Experts, Projection
from .vision_language_text import language_model_tensors

# this step's rotated K and normed V of each layer another layer reads (kv_source_layer)
SharedKV = dict[int, tuple[torch.Tensor, torch.Tensor]]


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, in float32 and cast back (Gemma 4's value norm)."""
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class Gemma4Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.source = config.kv_source_layer(layer_idx)
        self.full = config.layer_types[layer_idx] == FULL_ATTENTION
        self.num_heads, self.head_dim = config.num_attention_heads, config.layer_head_dim(layer_idx)
        self.num_kv_heads = config.layer_num_kv_heads(layer_idx)
        self.values_are_keys = self.full and config.global_values_are_keys
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        own = self.source == layer_idx
        kv_rows = 0 if not own else self.kv_size if self.values_are_keys else 2 * self.kv_size
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + kv_rows, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.eps = config.rms_norm_eps
        self.q_norm = Float32RMSNorm(self.head_dim, self.eps)
        self.k_norm = Float32RMSNorm(self.head_dim, self.eps) if own else None
        self.window = config.layer_windows[layer_idx]
        # whether a later layer reads this one's K/V (kept for it in the step's SharedKV)
        self.shares = own and any(
            config.kv_source_layer(j) == layer_idx for j in range(layer_idx + 1, config.num_hidden_layers)
        )

    def projection_rows(self) -> dict[str, tuple[int, int]]:
        """Where the checkpoint's projections go in qkv_proj (LlamaModel.load_hf_weights)."""
        q, kv = self.q_size, self.kv_size
        if self.source != self.layer_idx:
            return {"q_proj": (0, q)}
        if self.values_are_keys:
            return {"q_proj": (0, q), "k_proj": (q, q + kv)}
        return {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata, shared: SharedKV) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        q = RotaryEmbedding.apply_(self.q_norm(qkv[:, : self.q_size].view(T, self.num_heads, self.head_dim)), cos, sin)
        if self.k_norm is None:  # a KV-shared layer: its source's K/V, already in the cache
            k, v = shared[self.source]
        else:
            k_proj = qkv[:, self.q_size : self.q_size + self.kv_size].view(T, self.num_kv_heads, self.head_dim)
            v_proj = k_proj if self.values_are_keys else qkv[:, self.q_size + self.kv_size :].view(k_proj.shape)
            k = RotaryEmbedding.apply_(self.k_norm(k_proj), cos, sin)
            v = unweighted_rms_norm(v_proj, self.eps)
            if self.shares:
                shared[self.layer_idx] = (k, v)
        o = paged_attention(q, k, v, kv_cache, meta, 1.0, self.window, kv_written=self.k_norm is None)
        return self.o_proj(o.reshape(T, self.q_size))


class Gemma4Router(nn.Module):
    """Each token's top k experts and their weights: a softmax in float32 over the logits of the
    unweighted-normed stream times `scale` / sqrt(hidden), the top k renormalised, each times its
    expert's `per_expert_scale` (transformers' Gemma4TextRouter)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        H, E = config.hidden_size, config.num_experts
        self.proj = Projection(E, H)  # kept out of the packed layouts: the top k sees transformers' numbers
        self.scale = nn.Parameter(torch.ones(H))
        self.per_expert_scale = nn.Parameter(torch.ones(E))
        self.eps, self.top_k, self.root = config.rms_norm_eps, config.num_experts_per_tok, H**-0.5

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = unweighted_rms_norm(h, self.eps) * self.scale * self.root
        probs = F.softmax(self.proj(x), dim=-1, dtype=torch.float32)
        weight, index = torch.topk(probs, self.top_k, dim=-1)
        weight = weight / weight.sum(dim=-1, keepdim=True) * self.per_expert_scale[index]
        return index, weight.to(h.dtype)


class Gemma4MoeMLP(GatedMLP):
    """A mixture-of-experts layer's MLP: the dense GeGLU (`forward`) and, beside it, routed experts
    of their own width (`routed`), which the layer norms and adds (Gemma4DecoderLayer)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config.hidden_size, config.intermediate_size, config.hidden_activation)
        self.router = Gemma4Router(config)
        self.experts = Experts(
            config.num_experts, config.hidden_size, config.moe_intermediate_size, config.hidden_activation
        )

    def routed(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The experts on `x`, routed by the stream `h` before the MLP's norm."""
        index, weight = self.router(h)
        return self.experts(x, index, weight)


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.sliding = config.layer_windows[layer_idx] is not None
        self.input_layernorm = Float32RMSNorm(H, eps)
        self.self_attn = Gemma4Attention(config, layer_idx)
        self.post_attention_layernorm = Float32RMSNorm(H, eps)
        self.pre_feedforward_layernorm = Float32RMSNorm(H, eps)
        wide = config.double_wide_shared_mlp and config.kv_source_layer(layer_idx) != layer_idx
        self.moe = config.is_moe_layer(layer_idx)
        if self.moe:
            self.mlp: GatedMLP = Gemma4MoeMLP(config)
            self.post_feedforward_layernorm_1 = Float32RMSNorm(H, eps)  # the dense MLP's output
            self.pre_feedforward_layernorm_2 = Float32RMSNorm(H, eps)  # the experts' input
            self.post_feedforward_layernorm_2 = Float32RMSNorm(H, eps)  # their output
        else:
            self.mlp = GatedMLP(H, config.intermediate_size * (2 if wide else 1), config.hidden_activation)
        self.post_feedforward_layernorm = Float32RMSNorm(H, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))
        P = config.per_layer_input_size
        if P:
            self.per_layer_input_gate = nn.Linear(H, P, bias=False)
            self.per_layer_projection = nn.Linear(P, H, bias=False)
            self.post_per_layer_input_norm = Float32RMSNorm(H, eps)

    def forward(self, h, cos, sin, kv_cache, meta, shared: SharedKV, per_layer_input: torch.Tensor | None):
        """h: the residual stream (the model's own tensor: updated in place); returns the next."""
        attn = self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, meta, shared))
        h, x = self.pre_feedforward_layernorm.add_and_norm(h, attn)
        mlp = self.mlp(x)
        if self.moe:
            experts = cast(Gemma4MoeMLP, self.mlp).routed(h, self.pre_feedforward_layernorm_2(h))
            mlp = self.post_feedforward_layernorm_1(mlp) + self.post_feedforward_layernorm_2(experts)
        h = h + self.post_feedforward_layernorm(mlp)
        if per_layer_input is not None:
            gate = F.gelu(self.per_layer_input_gate(h), approximate="tanh") * per_layer_input
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return h.mul_(self.layer_scalar)


class Gemma4Model(LlamaModel):
    """forward(input_ids [T], positions [T], kv_caches, meta) -> final-normed hidden [T, H]."""

    fused_decode_layout = False  # Gemma 4's block is not what the fused decode kernel computes

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> None:
        if config.architecture not in GEMMA4_ARCHITECTURES:
            raise ValueError(f"Gemma4Model does not build {config.architecture}")
        super().__init__(config, dtype=dtype, device=device)
        self.reads_output_rows = config.num_kv_shared_layers > 0
        H, L, P = config.hidden_size, config.num_hidden_layers, config.per_layer_input_size
        if P:
            with torch.device("meta"):
                rows = config.per_layer_input_vocab_size
                self.embed_tokens_per_layer = nn.Embedding(rows, L * P, _weight=torch.empty(rows, L * P))
                self.per_layer_model_projection = nn.Linear(H, L * P, bias=False)
                self.per_layer_projection_norm = Float32RMSNorm(P, config.rms_norm_eps)
            materialize(self, device, dtype)
            # transformers scales by the square roots rounded to the weights' dtype
            self.per_layer_embed_scale = torch.tensor(P**0.5).to(dtype)
        keep_float32_norms(self)
        self.embed_scale = torch.tensor(H**0.5).to(dtype)

    def make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return Gemma4DecoderLayer(config, layer_idx)

    def make_norm(self, dim: int, eps: float) -> RMSNorm:
        return Float32RMSNorm(dim, eps)

    def make_rotary(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> RotaryEmbedding:
        """The full layers' table over their own head size (LlamaModel asks with the model's
        config); the sliding layers' (asked with a copy on their base) over theirs."""
        if config is self.config:
            return RotaryEmbedding(dataclasses.replace(config, head_dim=config.global_head_dim), dtype, device)
        return super().make_rotary(config, dtype, device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids).mul_(self.embed_scale)

    def gemma4_layers(self) -> list[Gemma4DecoderLayer]:
        return cast("list[Gemma4DecoderLayer]", list(self.layers))

    def per_layer_inputs(self, input_ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor | None:
        """[T, layers, per_layer_input_size]: each token's per-layer embedding plus the normed
        projection of its embedding `h`, over sqrt(2) (transformers' order)."""
        cfg = self.config
        if not cfg.per_layer_input_size:
            return None
        T, L, P = h.shape[0], cfg.num_hidden_layers, cfg.per_layer_input_size
        projected = self.per_layer_model_projection(h) * cfg.hidden_size**-0.5
        projected = self.per_layer_projection_norm(projected.view(T, L, P))
        embedded = self.embed_tokens_per_layer(input_ids).mul_(self.per_layer_embed_scale).view(T, L, P)
        return (projected + embedded) * 2**-0.5

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        lora_mapping: object | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As LlamaModel.forward, the KV-shared layers over `meta.output_rows` alone where the
        step names them (then those rows' hidden states alone are returned); `inputs_embeds` are
        refused where the model has per-layer inputs, which are looked up by token."""
        if inputs_embeds is not None and self.config.per_layer_input_size:
            raise ValueError(f"{self.config.architecture} with per-layer inputs takes token ids, not embeddings")
        h, full, local = self.begin_layers(input_ids, positions, kv_caches, meta, lora_mapping, inputs_embeds)
        per_layer = self.per_layer_inputs(input_ids.to(self.device), h)
        shared: SharedKV = {}
        dev = self.device
        first_shared = self.config.num_hidden_layers - self.config.num_kv_shared_layers
        with sdpa_kernel(CUDA_ATTENTION_BACKENDS) if dev.type == "cuda" else contextlib.nullcontext():
            for i, (layer, cache) in enumerate(zip(self.gemma4_layers(), kv_caches)):
                if i == first_shared and meta.output_rows is not None and len(meta.output_rows) < h.shape[0]:
                    # the KV-shared layers write no K/V: no other row of the step needs them
                    if not meta.output_rows:  # (a step of prompt chunks alone)
                        return h[:0]
                    rows = torch.tensor(meta.output_rows, dtype=torch.long, device=dev)
                    h, per_layer, meta = h[rows], None if per_layer is None else per_layer[rows], meta.of_output_rows()
                    full, local = (full[0][rows], full[1][rows]), (local[0][rows], local[1][rows])
                    shared = {j: (k[rows], v[rows]) for j, (k, v) in shared.items()}
                cos, sin = local if layer.sliding else full
                layer_input = None if per_layer is None else per_layer[:, i]
                h = layer(h, cos, sin, cache, meta.for_layer(i), shared, layer_input)
        return self.norm(h)

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As LlamaModel's, less the K/V projections and norms that released checkpoints keep for
        the KV-shared layers (transformers ignores them too); Gemma4ForConditionalGeneration's
        language model alone (its encoders are not loaded)."""
        cfg = self.config
        first_shared = cfg.num_hidden_layers - cfg.num_kv_shared_layers
        unused = ("k_proj", "v_proj", "k_norm", "v_norm")

        def used() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in language_model_tensors(weights, cfg.architecture):
                parts = name.split(".")
                if len(parts) > 4 and parts[:2] == ["model", "layers"]:
                    if int(parts[2]) >= first_shared and parts[3] == "self_attn" and parts[4] in unused:
                        continue
                    if parts[3] in ("experts", "router"):  # the layer's, held by its MLP (Gemma4MoeMLP)
                        name = ".".join([*parts[:3], "mlp", *parts[3:]])
                yield name, t

        super().load_hf_weights(used())
