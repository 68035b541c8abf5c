"""GLM-4 (transformers' Glm4ForCausalLM, THUDM's GLM-4-0414 and GLM-Z1): the Llama decoder's
attention (q/k/v biases; GLM's interleaved rotary over the first half of each head, its q/k rows
reordered at load: ModelConfig.rope_interleaved) and SwiGLU MLP in a sandwich block: an RMSNorm
before each sublayer and another on its output before the residual add."""

from __future__ import annotations

from torch import nn

from .config import ModelConfig
from .layers import GatedMLP, RMSNorm
from .llama import Attention, LlamaModel, static_mlp_unsupported


class Glm4DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_self_attn_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)  # before the MLP, transformers' name
        self.mlp = GatedMLP(H, config.intermediate_size)
        self.post_mlp_layernorm = RMSNorm(H, eps)

    def forward(self, h, x, cos, sin, kv_cache, meta, next_norm: RMSNorm):
        """As the Llama DecoderLayer: h the residual stream, x this layer's normed input."""
        h, x = self.post_attention_layernorm.add_and_norm(
            h, self.post_self_attn_layernorm(self.self_attn(x, cos, sin, kv_cache, meta))
        )
        return next_norm.add_and_norm(h, self.post_mlp_layernorm(self.mlp(x)))


class Glm4Model(LlamaModel):
    """forward(input_ids [T], positions [T], kv_caches, meta) -> final-normed hidden [T, H]."""

    fused_decode_layout = False  # the fused decode kernel computes Llama's pre-norm blocks

    def make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return Glm4DecoderLayer(config, layer_idx)

    def static_layer_unsupported(self, layer: nn.Module) -> str | None:
        """A GLM-4 layer runs over fixed buffers as Llama's: its attention is Llama's."""
        if type(layer) is not Glm4DecoderLayer:
            return f"{type(layer).__name__} layers"
        return static_mlp_unsupported(layer.mlp, self.dtype)
