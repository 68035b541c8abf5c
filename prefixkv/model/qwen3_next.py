"""Qwen3-Next (transformers' Qwen3NextForCausalLM): gated delta net layers (model/gated_delta.py,
a recurrent state per block) and, every few layers, gated full attention (q_proj gives each
head's query and an output gate; q/k norm; rotary over the first `rotary_dim` dimensions; the
output times sigmoid(gate) before o_proj, K/V rows per block). Each layer's MLP is routed experts
with a sigmoid-gated shared expert (model/moe.py) where the config makes it sparse, else dense.
Every norm but the delta net's is zero-centred, x / rms(x) * (1 + w): model/gemma.py's norm, the
1 added at load.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import cast

import torch
from torch import nn

from .attention import AttentionMetadata, paged_attention
from .config import ModelConfig
from .gated_delta import GatedDeltaNet
from .gemma import GemmaRMSNorm
from .layer_kinds import LINEAR_ATTENTION
from .layers import RMSNorm, RotaryEmbedding
from .llama import LlamaModel, static_mlp_unsupported
from .mamba2 import as_kv, as_state
from .moe import build_mlp


class GatedAttention(nn.Module):
    """Full attention with an output gate per head dimension and partial rotary."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        H = config.hidden_size
        # each head's query, then its gate (transformers' q_proj)
        self.query_gate_proj = nn.Linear(H, 2 * self.q_size, bias=False)
        self.key_proj = nn.Linear(H, kv_size, bias=False)
        self.value_proj = nn.Linear(H, kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, H, bias=False)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_dim = config.rotary_dim
        self.scale = self.head_dim**-0.5
        self.window = config.layer_windows[layer_idx]

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        d = self.rotary_dim
        return torch.cat([RotaryEmbedding.apply(x[..., :d], cos, sin), x[..., d:]], dim=-1)

    def forward(self, x, cos, sin, kv_cache, meta):
        T = x.shape[0]
        q, gate = self.query_gate_proj(x).view(T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self._rotate(self.q_norm(q.contiguous()), cos, sin)  # contiguous: the native norm's rows
        k = self._rotate(self.k_norm(self.key_proj(x).view(T, self.num_kv_heads, self.head_dim)), cos, sin)
        v = self.value_proj(x).view(T, self.num_kv_heads, self.head_dim)
        o = paged_attention(q, k, v, kv_cache, meta, scale=self.scale, window=self.window)
        o = o.reshape(T, self.q_size) * torch.sigmoid(gate.reshape(T, self.q_size))
        return self.o_proj(o)


class Qwen3NextDecoderLayer(nn.Module):
    """norm -> gated delta net or gated attention -> residual add; norm -> MLP -> residual add."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(H, eps)
        linear = config.layer_types[layer_idx] == LINEAR_ATTENTION
        self.linear_attn = GatedDeltaNet(config) if linear else None
        self.self_attn = None if linear else GatedAttention(config, layer_idx)
        self.post_attention_layernorm = GemmaRMSNorm(H, eps)
        self.mlp = build_mlp(config, layer_idx)

    def forward(self, h, x, cos, sin, cache, meta: AttentionMetadata, next_norm: RMSNorm):
        """As the Llama DecoderLayer: h the residual stream, x this layer's normed input; returns
        the new stream and `next_norm` of it. `cache`: a RecurrentState for a delta net layer, the
        K/V tensor for an attention layer."""
        if self.linear_attn is not None:
            out = self.linear_attn(x, as_state(cache), meta)
        else:
            assert self.self_attn is not None
            out = self.self_attn(x, cos, sin, as_kv(cache), meta)
        h, x = self.post_attention_layernorm.add_and_norm(h, out)
        return next_norm.add_and_norm(h, self.mlp(x))


# transformers' attention projections -> this model's (LlamaModel's loader would fuse q/k/v)
_RENAMES = {
    "self_attn.q_proj.": "self_attn.query_gate_proj.",
    "self_attn.k_proj.": "self_attn.key_proj.",
    "self_attn.v_proj.": "self_attn.value_proj.",
}
# the zero-centred norms, stored as 1 + w
_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight")


class Qwen3NextModel(LlamaModel):
    """forward(input_ids [T], positions [T], caches (per layer a K/V tensor or a RecurrentState),
    meta) -> final-normed hidden [T, H]: the Llama decoder's loop with Qwen3-Next's layers."""

    fused_decode_layout = False  # the native decode kernel computes Llama layers only

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__(config, dtype, device)
        for m in self.modules():
            if isinstance(m, GemmaRMSNorm):  # 1 + w kept in float32 (GemmaRMSNorm)
                m.weight.data = m.weight.data.float()

    def make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return Qwen3NextDecoderLayer(config, layer_idx)

    def static_layer_unsupported(self, layer: nn.Module) -> str | None:
        """A Qwen3-Next layer runs over fixed buffers: the delta net's decode reads its state's
        blocks from them (mamba2._static_plan), gated attention goes through paged_attention."""
        if type(layer) is not Qwen3NextDecoderLayer:
            return f"{type(layer).__name__} layers"
        return static_mlp_unsupported(layer.mlp, self.dtype)

    def make_norm(self, dim: int, eps: float) -> RMSNorm:
        return GemmaRMSNorm(dim, eps)

    def init_random_weights(self, seed: int = 0, std: float = 0.02) -> None:
        super().init_random_weights(seed, std)
        with torch.no_grad():
            for layer in self.layers:
                mixer = cast(Qwen3NextDecoderLayer, layer).linear_attn
                if mixer is not None:
                    mixer.A_log.copy_(torch.log(torch.arange(1, mixer.v_heads + 1, dtype=torch.float32)))
                    mixer.dt_bias.fill_(1.0)

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """transformers' names (model.layers.N.{linear_attn.*, self_attn.*, mlp.*,
        input_layernorm, post_attention_layernorm}, model.norm, lm_head), each zero-centred norm
        stored as 1 + w; the multi-token-prediction head (mtp.*), which transformers' CausalLM
        does not load either, skipped. ValueError on an unknown name, a wrong shape or a missing
        one."""

        def renamed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in weights:
                if name.startswith("mtp."):
                    continue
                for old, new in _RENAMES.items():
                    name = name.replace(old, new)
                if name == "model.norm.weight" or name.endswith(_CENTRED):
                    t = t.float() + 1.0
                yield name, t

        super().load_hf_weights(renamed())
