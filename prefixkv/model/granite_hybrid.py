"""Granite 4 (transformers' GraniteMoeHybridForCausalLM): Bamba's layers (model/hybrid.py: Mamba2
mixers and a few GQA attention layers) with Granite 3's four multipliers (model/granite.py), and
after the mixer or attention a shared SwiGLU MLP, beside routed experts where the config has them
(their top-k logits softmaxed: moe.py's router with its top-k weights renormalised, the shared
expert ungated). Attention has no rotary where `position_embedding_type` is not "rope" (Granite
4's released checkpoints: NoPE)."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from .config import ModelConfig
from .granite import GraniteScaling
from .hybrid import HybridDecoderLayer, HybridModel
from .layers import RMSNorm
from .llama import renamed
from .mamba2 import as_kv, as_state
from .moe import build_mlp


class GraniteHybridDecoderLayer(HybridDecoderLayer):
    """HybridDecoderLayer with each sublayer's output times `residual_multiplier` before its
    residual add, and the MLP routed experts plus the shared one (or the shared one alone)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx, mlp=build_mlp(config, layer_idx))
        self.residual_multiplier = config.residual_multiplier

    def forward(self, h, x, cos, sin, cache, meta, next_norm: RMSNorm):
        m = self.residual_multiplier
        if self.mamba is not None:
            out = self.mamba(x, as_state(cache), meta)
        else:
            assert self.self_attn is not None
            out = self.self_attn(x, cos, sin, as_kv(cache), meta)
        h, x = self.post_attention_layernorm.add_and_norm(h, out.mul_(m))
        return next_norm.add_and_norm(h, self.mlp(x).mul_(m))


_LAYER = r"^(model\.layers\.\d+)\."
# transformers' names -> the Llama decoder's (the shared MLP's, which depend on the experts, below)
# (the checkpoints' names - router.layer, input_linear [E, 2I, H] gate rows first, output_linear -
# and transformers 5's in memory)
_RENAMES = (
    (re.compile(_LAYER + r"block_sparse_moe\.router\.(layer\.)?weight$"), r"\1.mlp.gate.weight"),
    (re.compile(_LAYER + r"block_sparse_moe\.input_linear\.weight$"), r"\1.mlp.experts.gate_up_proj"),
    (re.compile(_LAYER + r"block_sparse_moe\.output_linear\.weight$"), r"\1.mlp.experts.down_proj"),
    (re.compile(_LAYER + r"block_sparse_moe\.experts\."), r"\1.mlp.experts."),
)


class GraniteHybridModel(GraniteScaling, HybridModel):
    """forward(input_ids [T], positions [T], caches, meta) -> final-normed hidden [T, H]."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> None:
        if config.architecture != "GraniteMoeHybridForCausalLM":
            raise ValueError(f"GraniteHybridModel does not build {config.architecture}")
        super().__init__(config, dtype=dtype, device=device)

    def make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return GraniteHybridDecoderLayer(config, layer_idx)

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The checkpoint's names: the Mamba and attention layers as Bamba's, the router
        (block_sparse_moe.router.layer.weight), the experts (block_sparse_moe.input_linear
        [E, 2I, H], gate rows first, and output_linear) and the shared MLP
        (shared_mlp.input_linear, gate rows then up rows, and output_linear): the shared expert
        beside routed experts, the layer's dense MLP without them."""
        shared = "mlp.shared_expert" if self.config.num_experts else "mlp"
        renames = (
            *_RENAMES,
            (re.compile(_LAYER + r"shared_mlp\.input_linear\."), rf"\1.{shared}.gate_up_proj."),
            (re.compile(_LAYER + r"shared_mlp\.output_linear\."), rf"\1.{shared}.down_proj."),
        )
        super().load_hf_weights(renamed(weights, renames))
