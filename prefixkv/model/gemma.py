"""The Gemma 2 / Gemma 3 decoder (text): the Llama decoder's attention and weights with Gemma's
block - (1 + w) RMSNorm, a norm after attention and around the MLP (sandwich norms), GeGLU,
embeddings scaled by sqrt(hidden_size), attention scaled by query_pre_attn_scalar, sliding and
full layers interleaved (Gemma 3's sliding layers on their own rotary base), and logit
soft-capping (Gemma 2: scores in attention and the final logits)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import cast

import torch
from torch import nn
from torch.nn.attention import sdpa_kernel

from .attention import AttentionMetadata
from .config import ModelConfig
from .layers import Float32RMSNorm, GatedMLP, RMSNorm, keep_float32_norms
from .llama import CUDA_ATTENTION_BACKENDS, Attention, LlamaModel


class GemmaRMSNorm(Float32RMSNorm):
    """Gemma's norm, x / rms(x) * (1 + w). The parameter holds 1 + w (added once at load, as
    llama.cpp's GGUF files store it) and stays float32 in every model dtype: transformers adds
    the 1 and scales in float32 before casting back, and 1 + w rounded to bfloat16 would lose w's
    low bits. In float32 it is the Llama norm (native kernel included)."""


class GemmaAttention(Attention):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx, norm=GemmaRMSNorm)
        if config.query_pre_attn_scalar is not None:
            self.scale = config.query_pre_attn_scalar**-0.5
        self.softcap = config.attn_logit_softcapping


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.sliding = config.layer_windows[layer_idx] is not None
        self.input_layernorm = GemmaRMSNorm(H, eps)
        self.self_attn = GemmaAttention(config, layer_idx)
        self.post_attention_layernorm = GemmaRMSNorm(H, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(H, eps)
        self.mlp = GatedMLP(H, config.intermediate_size, config.hidden_activation)
        self.post_feedforward_layernorm = GemmaRMSNorm(H, eps)

    def forward(self, h, x, cos, sin, kv_cache, meta, next_norm: RMSNorm):
        """h: the residual stream, x: input_layernorm(h) (from the previous layer); returns the new
        stream and `next_norm` of it, each residual add fused with the norm after it."""
        attn = self.post_attention_layernorm(self.self_attn(x, cos, sin, kv_cache, meta))
        h, x = self.pre_feedforward_layernorm.add_and_norm(h, attn)
        return next_norm.add_and_norm(h, self.post_feedforward_layernorm(self.mlp(x)))


class GemmaModel(LlamaModel):
    """forward(input_ids [T], positions [T], kv_caches, meta) -> final-normed hidden [T, H]."""

    fused_decode_layout = False  # Gemma's block is not what the fused decode kernel computes

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> None:
        if not config.is_gemma:
            raise ValueError(f"GemmaModel does not build {config.architecture}")
        super().__init__(config, dtype=dtype, device=device)
        keep_float32_norms(self)
        # transformers multiplies by sqrt(hidden_size) rounded to the embedding's dtype
        self.embed_scale = torch.tensor(config.hidden_size**0.5).to(dtype)

    def make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return GemmaDecoderLayer(config, layer_idx)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids).mul_(self.embed_scale)

    def make_norm(self, dim: int, eps: float) -> RMSNorm:
        return GemmaRMSNorm(dim, eps)

    def gemma_layers(self) -> list[GemmaDecoderLayer]:
        return cast("list[GemmaDecoderLayer]", list(self.layers))

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
        """As LlamaModel.forward; `inputs_embeds` are taken as they are (already scaled)."""
        h, full, local = self.begin_layers(input_ids, positions, kv_caches, meta, lora_mapping, inputs_embeds)
        layers = self.gemma_layers()
        x = layers[0].input_layernorm(h) if layers else self.norm(h)
        dev = self.device
        with sdpa_kernel(CUDA_ATTENTION_BACKENDS) if dev.type == "cuda" else contextlib.nullcontext():
            for i, (layer, cache) in enumerate(zip(layers, kv_caches)):
                next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm
                cos, sin = local if layer.sliding else full
                h, x = layer(h, x, cos, sin, cache, meta.for_layer(i), next_norm)
        return x

    def static_decode_unsupported(self) -> str | None:
        """Gemma's block over fixed buffers: every layer Gemma's (Gemma 2's soft-capped scores
        capped by Triton's kernels there), dense MLPs. The final logits' cap is applied after the
        forward, outside any graph."""
        for layer in self.gemma_layers():
            if type(layer) is not GemmaDecoderLayer or type(layer.self_attn) is not GemmaAttention:
                return f"{type(layer).__name__} layers"
            if not isinstance(layer.mlp, GatedMLP):
                return f"{type(layer.mlp).__name__} MLPs"
        return None

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As LlamaModel's, with every norm weight w stored as 1 + w (in float32; GemmaRMSNorm)."""

        def folded() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in weights:
                yield (name, t.float() + 1.0) if name.endswith("norm.weight") else (name, t)

        super().load_hf_weights(folded())
