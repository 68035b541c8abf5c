"""MiniMax-M2 (transformers' MiniMaxM2ForCausalLM; configs/minimax_m2.py): the Llama decoder with q
and k each normed over its whole projection (every head at once), rotary over the first part of
each head, and routed experts in every layer (moe.py: a sigmoid router with a selection bias)."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from .config import ModelConfig
from .llama import DecoderLayer, LlamaModel, ProjectionNormedAttention, below_layer, renamed, static_mlp_unsupported

# the router's selection bias, beside the router in transformers' MoE block (block_sparse_moe.,
# which the Llama loader reads as mlp.)
_RENAMES = ((re.compile(r"\.(block_sparse_moe|mlp)\.e_score_correction_bias$"), ".mlp.expert_bias"),)


class MiniMaxM2Model(LlamaModel):
    """forward(input_ids [T], positions [T], kv_caches, meta) -> final-normed hidden [T, H]."""

    fused_decode_layout = False  # the fused decode kernel norms q and k per head, if at all

    def make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return DecoderLayer(config, layer_idx, attention=ProjectionNormedAttention)

    def static_layer_unsupported(self, layer: nn.Module) -> str | None:
        """A MiniMax-M2 layer runs over fixed buffers as Llama's: its norms are plain ops."""
        if type(layer) is not DecoderLayer or type(layer.self_attn) is not ProjectionNormedAttention:
            return f"{type(layer).__name__} layers"
        return static_mlp_unsupported(layer.mlp, self.dtype)

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """transformers' names (block_sparse_moe.{gate, e_score_correction_bias, experts.E.w1..w3}
        or the stacked experts, self_attn.{q,k}_norm over the whole projection); the
        multi-token-prediction modules after the last layer are left out."""
        super().load_hf_weights(renamed(below_layer(weights, self.config.num_hidden_layers), _RENAMES))
