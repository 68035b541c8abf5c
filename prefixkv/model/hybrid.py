"""Hybrids of Mamba2 and attention: Bamba (transformers' BambaForCausalLM: Mamba2 layers and a few
Llama-style GQA attention layers at `attn_layer_indices`, rotary over the first half of each
head) and, with its muP multipliers in model/falcon_h1.py, Falcon-H1 (a Mamba2 mixer and
attention side by side in every layer, their outputs summed). A SwiGLU MLP follows the mixer
and/or attention in each layer, with the residual around both.

A Mamba mixer is model/mamba2.py's with its per-block state (a `RecurrentState`), attention keeps
its K/V rows; both live in the same blocks, so a prefix hit of k blocks restores the mixers'
state at the end of block k - 1 and attention's K/V of blocks 0..k-1 together.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import cast

import torch
from torch import nn

from .attention import AttentionMetadata
from .config import ModelConfig
from .layers import GatedMLP, RMSNorm
from .llama import Attention, LlamaModel, renamed, static_mlp_unsupported
from .mamba2 import Mamba2Mixer, as_kv, as_state


class HybridDecoderLayer(nn.Module):
    """norm -> Mamba2 mixer and/or attention (summed) -> residual add; norm -> SwiGLU MLP ->
    residual add."""

    def __init__(self, config: ModelConfig, layer_idx: int, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mamba = Mamba2Mixer(config) if config.is_recurrent_layer(layer_idx) else None
        self.self_attn: Attention | None = None
        if config.is_attention_layer(layer_idx):
            self.self_attn = Attention(config, layer_idx)  # rotary over the first rotary_dim dimensions
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size) if mlp is None else mlp

    def forward(self, h, x, cos, sin, cache, meta: AttentionMetadata, next_norm: RMSNorm):
        """As the Llama DecoderLayer: h the residual stream, x this layer's normed input; returns
        the new stream and `next_norm` of it. `cache`: a RecurrentState for a Mamba layer, the
        K/V tensor for an attention layer, the pair (K/V, RecurrentState) for a layer with both."""
        if self.mamba is not None and self.self_attn is not None:
            kv, state = cache
            out = self.mamba(x, as_state(state), meta)
            out += self.self_attn(x, cos, sin, as_kv(kv), meta)
        elif self.mamba is not None:
            out = self.mamba(x, as_state(cache), meta)
        else:
            assert self.self_attn is not None
            out = self.self_attn(x, cos, sin, as_kv(cache), meta)
        h, x = self.post_attention_layernorm.add_and_norm(h, out)
        return next_norm.add_and_norm(h, self.mlp(x))


# transformers' Bamba names -> the Llama decoder's, whose loader fuses q/k/v and gate/up
_RENAMES = (
    (re.compile(r"^model\.final_layernorm\."), "model.norm."),
    (re.compile(r"^(model\.layers\.\d+)\.feed_forward\."), r"\1.mlp."),
    (re.compile(r"^(model\.layers\.\d+)\.pre_ff_layernorm\."), r"\1.post_attention_layernorm."),
)


class HybridModel(LlamaModel):
    """forward(input_ids [T], positions [T], caches (per layer a K/V tensor or a RecurrentState),
    meta) -> final-normed hidden [T, H]: the Llama decoder's loop with hybrid layers."""

    fused_decode_layout = False  # the native decode kernel computes Llama layers only

    def make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return HybridDecoderLayer(config, layer_idx)

    def static_layer_unsupported(self, layer: nn.Module) -> str | None:
        """A hybrid layer runs over fixed buffers: its mixer's decode reads its state's blocks
        from them (mamba2._static_plan), its attention is Llama's."""
        if type(layer) is not HybridDecoderLayer:
            return f"{type(layer).__name__} layers"
        attn = layer.self_attn
        if attn is not None and type(attn) is not Attention:
            return f"{type(attn).__name__} attention"
        return static_mlp_unsupported(layer.mlp, self.dtype)

    def init_random_weights(self, seed: int = 0, std: float = 0.02) -> None:
        super().init_random_weights(seed, std)
        with torch.no_grad():
            for layer in self.layers:
                mixer = cast(HybridDecoderLayer, layer).mamba
                if mixer is not None:
                    mixer.A_log.copy_(torch.log(torch.arange(1, mixer.heads + 1, dtype=torch.float32)))
                    mixer.D.fill_(1.0)

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """transformers' names (model.layers.N.{mamba.*, self_attn.*, feed_forward.*,
        input_layernorm, pre_ff_layernorm}, model.final_layernorm, lm_head); ValueError on an
        unknown name, a wrong shape or a missing one."""
        super().load_hf_weights(renamed(weights, _RENAMES))
