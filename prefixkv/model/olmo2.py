"""OLMo 2 and OLMo 3 (AI2's fully open decoders): the Llama decoder's attention and MLP in a block
of its own - no norm before a sublayer, an RMSNorm on each sublayer's output before the residual
add (post-norm), q and k normed over their whole projection (all heads at once, before the split
into heads) - with transformers' float32-scaled norms. OLMo 3 interleaves sliding and full
layers, the sliding ones on their own unscaled rotary where the full ones' is scaled."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn.attention import sdpa_kernel

from .attention import AttentionMetadata
from .config import ModelConfig
from .layers import Float32RMSNorm, RMSNorm, keep_float32_norms
from .llama import CUDA_ATTENTION_BACKENDS, LlamaModel, ProjectionNormedAttention
from .moe import build_mlp


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = ProjectionNormedAttention(config, layer_idx, Float32RMSNorm)
        self.post_attention_layernorm = Float32RMSNorm(H, eps)
        self.mlp = build_mlp(config, layer_idx)
        self.post_feedforward_layernorm = Float32RMSNorm(H, eps)

    def forward(self, h, cos, sin, kv_cache, meta):
        """h: the residual stream (updated in place)."""
        h = h.add_(self.post_attention_layernorm(self.self_attn(h, cos, sin, kv_cache, meta)))
        return h.add_(self.post_feedforward_layernorm(self.mlp(h)))


class Olmo2Model(LlamaModel):
    """forward(input_ids [T], positions [T], kv_caches, meta) -> final-normed hidden [T, H]."""

    fused_decode_layout = False  # the fused decode kernel computes pre-norm blocks

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> None:
        if config.architecture not in ("Olmo2ForCausalLM", "Olmo3ForCausalLM"):
            raise ValueError(f"Olmo2Model does not build {config.architecture}")
        super().__init__(config, dtype=dtype, device=device)
        keep_float32_norms(self)

    def make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return Olmo2DecoderLayer(config, layer_idx)

    def make_norm(self, dim: int, eps: float) -> RMSNorm:
        return Float32RMSNorm(dim, eps)

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
        """As LlamaModel.forward."""
        h, full, local = self.begin_layers(input_ids, positions, kv_caches, meta, lora_mapping, inputs_embeds)
        dev = self.device
        windows = self.config.layer_windows
        with sdpa_kernel(CUDA_ATTENTION_BACKENDS) if dev.type == "cuda" else contextlib.nullcontext():
            for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
                cos, sin = local if windows[i] is not None else full
                h = layer(h, cos, sin, cache, meta.for_layer(i))
        return self.norm(h)

    def static_layer_unsupported(self, layer: nn.Module) -> str | None:
        return "OLMo's post-norm block (its own forward)"
