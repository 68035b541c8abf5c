"""Granite 3 (IBM's dense decoder): the Llama decoder with four multipliers, applied where
transformers applies them - the embeddings times `embedding_multiplier` (the embedding is often
tied to the head, so it is not folded into the weight), each sublayer's output times
`residual_multiplier` before it joins the residual stream (not folded into o_proj / down_proj,
which a LoRA adapter's delta on them would then miss), attention scaled by
`attention_multiplier` instead of head_dim ** -0.5, and the logits divided by `logits_scaling`."""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .layers import RMSNorm
from .llama import DecoderLayer, LlamaModel


class GraniteDecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)  # (its attention takes the config's attention_multiplier)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, h, x, cos, sin, kv_cache, meta, next_norm: RMSNorm):
        m = self.residual_multiplier
        attn = self.self_attn(x, cos, sin, kv_cache, meta).mul_(m)
        h, x = self.post_attention_layernorm.add_and_norm(h, attn)
        return next_norm.add_and_norm(h, self.mlp(x).mul_(m))


class GraniteScaling(LlamaModel):
    """The embeddings times `embedding_multiplier` and the logits divided by `logits_scaling`, for
    Granite 3 and (beside Bamba's layers) Granite 4; their layers' multiplied residual adds run
    eager."""

    fused_decode_layout = False  # the fused decode kernel has no multipliers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids).mul_(self.config.embedding_multiplier)

    def static_layer_unsupported(self, layer: nn.Module) -> str | None:
        return "Granite's multiplied residual adds (its own layers)"

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.config.logits_scaling


class GraniteModel(GraniteScaling):
    """forward(input_ids [T], positions [T], kv_caches, meta) -> final-normed hidden [T, H]."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> None:
        if config.architecture != "GraniteForCausalLM":
            raise ValueError(f"GraniteModel does not build {config.architecture}")
        super().__init__(config, dtype=dtype, device=device)

    def make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return GraniteDecoderLayer(config, layer_idx)
