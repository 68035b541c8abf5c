"""LFM2 (transformers' Lfm2ForCausalLM, Liquid AI's hybrid for devices): most layers a gated short
convolution, a few GQA attention layers (q/k normed per head, rotary over each whole head), each
followed by a SwiGLU MLP, pre-norm with residuals around both. LFM2-MoE (Lfm2MoeForCausalLM): the
same layers, the MLP routed experts after the first `num_dense_layers` (moe.py's block with a
sigmoid router whose top k is chosen with a learned per-expert bias).

The short convolution: in_proj gives B, C and x; the depthwise causal conv (kernel
`short_conv_kernel`, no activation) runs over B * x; the output is C times it, through out_proj.
Its state per block is the conv's last inputs (a `RecurrentState` without an SSM part), kept as
model/mamba2.py keeps Mamba2's, so a prefix hit of k blocks restores it at the end of block k - 1.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from .attention import AttentionMetadata
from .config import ModelConfig
from .layers import RMSNorm
from .llama import Attention, LlamaModel, renamed, static_mlp_unsupported
from .mamba2 import RecurrentState, _plan, as_kv, as_state, block_causal_conv
from .moe import build_mlp


class ShortConv(nn.Module):
    """forward(x [T, hidden], state, meta) -> [T, hidden]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        H, bias = config.hidden_size, config.short_conv_bias
        self.in_proj = nn.Linear(H, 3 * H, bias=bias)
        self.conv = nn.Conv1d(H, H, config.short_conv_kernel, groups=H, bias=bias)
        self.out_proj = nn.Linear(H, H, bias=bias)

    def forward(self, x: torch.Tensor, state: RecurrentState, meta: AttentionMetadata) -> torch.Tensor:
        plan = _plan(meta, state.block_size, x.device)
        b, c, v = self.in_proj(x).chunk(3, dim=-1)
        conv = block_causal_conv(self.conv, b * v, state.conv, plan, silu=False)
        return self.out_proj(c * conv)


class Lfm2DecoderLayer(nn.Module):
    """norm -> short convolution or attention -> residual add; norm -> SwiGLU MLP -> residual add."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)
        recurrent = config.is_recurrent_layer(layer_idx)
        self.conv = ShortConv(config) if recurrent else None
        self.self_attn = None if recurrent else Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = build_mlp(config, layer_idx)

    def forward(self, h, x, cos, sin, cache, meta: AttentionMetadata, next_norm: RMSNorm):
        """As the Llama DecoderLayer: h the residual stream, x this layer's normed input; returns
        the new stream and `next_norm` of it. `cache`: a RecurrentState for a convolution layer,
        the K/V tensor for an attention layer."""
        if self.conv is not None:
            out = self.conv(x, as_state(cache), meta)
        else:
            assert self.self_attn is not None
            out = self.self_attn(x, cos, sin, as_kv(cache), meta)
        h, x = self.post_attention_layernorm.add_and_norm(h, out)
        return next_norm.add_and_norm(h, self.mlp(x))


# transformers' LFM2 names -> the Llama decoder's, whose loader fuses q/k/v and gate/up
_RENAMES = (
    (re.compile(r"^model\.embedding_norm\."), "model.norm."),
    (re.compile(r"^(model\.layers\.\d+)\.operator_norm\."), r"\1.input_layernorm."),
    (re.compile(r"^(model\.layers\.\d+)\.ffn_norm\."), r"\1.post_attention_layernorm."),
    (re.compile(r"^(model\.layers\.\d+)\.feed_forward\.w1\."), r"\1.mlp.gate_proj."),
    (re.compile(r"^(model\.layers\.\d+)\.feed_forward\.w3\."), r"\1.mlp.up_proj."),
    (re.compile(r"^(model\.layers\.\d+)\.feed_forward\.w2\."), r"\1.mlp.down_proj."),
    (re.compile(r"^(model\.layers\.\d+)\.feed_forward\."), r"\1.mlp."),  # LFM2-MoE's router, experts, bias
    (re.compile(r"^(model\.layers\.\d+)\.self_attn\.out_proj\."), r"\1.self_attn.o_proj."),
    (re.compile(r"^(model\.layers\.\d+)\.self_attn\.q_layernorm\."), r"\1.self_attn.q_norm."),
    (re.compile(r"^(model\.layers\.\d+)\.self_attn\.k_layernorm\."), r"\1.self_attn.k_norm."),
)


class Lfm2Model(LlamaModel):
    """forward(input_ids [T], positions [T], caches (per layer a K/V tensor or a RecurrentState),
    meta) -> final-normed hidden [T, H]: the Llama decoder's loop with LFM2's layers."""

    fused_decode_layout = False  # the native decode kernel computes Llama layers only

    def make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return Lfm2DecoderLayer(config, layer_idx)

    def static_layer_unsupported(self, layer: nn.Module) -> str | None:
        """An LFM2 layer runs over fixed buffers: the convolution reads its state's blocks from
        them (mamba2._static_plan), attention is Llama's."""
        if type(layer) is not Lfm2DecoderLayer:
            return f"{type(layer).__name__} layers"
        return static_mlp_unsupported(layer.mlp, self.dtype)

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """transformers' names (model.layers.N.{conv.*, self_attn.*, feed_forward.{w1,w2,w3} or
        LFM2-MoE's feed_forward.{gate, experts.E.w1..., expert_bias}, operator_norm, ffn_norm},
        model.embedding_norm, lm_head); ValueError on an unknown name, a wrong shape or a missing
        one."""
        super().load_hf_weights(renamed(weights, _RENAMES))
