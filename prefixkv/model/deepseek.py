"""DeepSeek-V3 (and Kimi K2, GLM-4.7-Flash: transformers' DeepseekV3ForCausalLM and
Glm4MoeLiteForCausalLM; configs/deepseek.py): multi-head latent attention, then the dense MLP in
the first layers and routed experts beside a shared one in the rest (moe.py: GLM-4.5's router).

Multi-head latent attention caches, per token, one latent c (kv_lora_rank, normed) and one rotary
key k_r shared by every head; transformers expands them into each head's key [W_UK c, k_r] and
value W_UV c before attending. Here the expansion is folded into the query and the output, as
vLLM does ("absorbed"): head h's score q_h . [W_UK_h c, k_r] is [q_nope_h W_UK_h, q_rot_h] .
[c, k_r], and its output sum_j p_j W_UV_h c_j is W_UV_h (sum_j p_j c_j). So attention runs as one
K/V head of [c, k_r] (its value the same row: the rotary part of the output is dropped) under
every query head, and the paged cache holds that row once (attention.kv_cache_block_shape's
`value_is_key`): kv_lora_rank + qk_rope_head_dim numbers a token and layer (576 for DeepSeek-V3,
where the expanded keys and values would be 40,960). The products are the same as transformers'
up to the order of their sums."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from .attention import AttentionMetadata, paged_attention
from .config import ModelConfig
from .glm4_moe import ROUTED_EXPERT_RENAMES
from .layers import RMSNorm, RotaryEmbedding, yarn_mscale
from .llama import DecoderLayer, LlamaModel, below_layer, renamed, static_mlp_unsupported
from .moe import Projection

# DeepSeek's latent norms keep their class's default epsilon, not the config's rms_norm_eps
LATENT_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    """Layer `layer_idx`'s multi-head latent attention: forward(x [T, H], cos, sin, kv_cache, meta)
    -> [T, H], its cache one head of the latent and the rotary key."""

    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        H, hidden = config.num_attention_heads, config.hidden_size
        self.num_heads = H
        self.rank = config.mla_kv_lora_rank
        self.nope, self.rope, self.v_dim = (
            config.mla_qk_nope_head_dim,
            config.mla_qk_rope_head_dim,
            config.mla_v_head_dim,
        )
        q_width = H * (self.nope + self.rope)
        bias = config.attention_bias
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        self.query_proj: nn.Linear | None = None  # transformers' q_proj, without a rank
        if config.mla_q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, config.mla_q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.mla_q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(config.mla_q_lora_rank, q_width, bias=False)
        else:
            self.query_proj = nn.Linear(hidden, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        # read as W_UK / W_UV per head by the folded products, never as one matmul: a plain
        # parameter, which the CPU's weight layouts (pack_linears) leave as it is
        self.kv_b_proj = Projection(H * (self.nope + self.v_dim), self.rank)
        self.o_proj = nn.Linear(H * self.v_dim, hidden, bias=bias)
        scale = (self.nope + self.rope) ** -0.5
        rs = config.rope_scaling or {}
        if rs.get("mscale_all_dim"):  # YaRN's correction, squared, on the softmax scale (DeepSeek's rule)
            scale *= yarn_mscale(float(rs["factor"]), float(rs["mscale_all_dim"])) ** 2
        self.scale = scale

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        T, H = x.shape[0], self.num_heads
        if self.q_b_proj is not None:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            assert self.query_proj is not None
            q = self.query_proj(x)
        q_nope, q_rot = q.view(T, H, self.nope + self.rope).split((self.nope, self.rope), dim=-1)
        c, k_rot = self.kv_a_proj_with_mqa(x).split((self.rank, self.rope), dim=-1)
        latent = torch.cat((self.kv_a_layernorm(c), k_rot), dim=-1).view(T, 1, self.rank + self.rope)
        latent[..., self.rank :] = RotaryEmbedding.apply(latent[..., self.rank :], cos, sin)
        w = self.kv_b_proj.weight.view(H, self.nope + self.v_dim, self.rank)
        # head h's query in the latent's space: q_nope_h W_UK_h [T, H, rank]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w[:, : self.nope]).transpose(0, 1)
        query = torch.cat((q_latent, RotaryEmbedding.apply(q_rot, cos, sin)), dim=-1)
        # the cache holds each latent once, seen as both keys and values (kv_cache_block_shape)
        both = kv_cache.expand(2, *kv_cache.shape[1:])
        o = paged_attention(query, latent, latent, both, meta, self.scale)  # [T, H, rank + rope]
        # each head's value: W_UV_h (sum_j p_j c_j) [T, H * v_dim]
        v = torch.bmm(o[..., : self.rank].transpose(0, 1), w[:, self.nope :].transpose(1, 2))
        return self.o_proj(v.transpose(0, 1).reshape(T, H * self.v_dim))


# transformers' names -> this model's: a query without a rank (the Llama loader would take q_proj
# into q/k/v), and GLM-4.5's experts' names
_RENAMES = ((re.compile(r"\.self_attn\.q_proj\."), ".self_attn.query_proj."), *ROUTED_EXPERT_RENAMES)


class DeepseekV3Model(LlamaModel):
    """forward(input_ids [T], positions [T], kv_caches, meta) -> final-normed hidden [T, H]."""

    fused_decode_layout = False  # the fused decode kernel computes Llama's attention

    def make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return DecoderLayer(config, layer_idx, attention=LatentAttention)

    def make_rotary(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> RotaryEmbedding:
        """The rotary table over the rotary key's dimensions (qk_rope_head_dim)."""
        plain = dataclasses.replace(
            config, head_dim=config.mla_qk_rope_head_dim, num_key_value_heads=config.num_attention_heads,
            partial_rotary_factor=1.0, mla_kv_lora_rank=0,
        )  # fmt: skip
        return RotaryEmbedding(plain, dtype, device)

    def static_layer_unsupported(self, layer: nn.Module) -> str | None:
        """A layer runs over fixed buffers: its attention is one paged head under every query head,
        its folded products plain ops."""
        if type(layer) is not DecoderLayer or type(layer.self_attn) is not LatentAttention:
            return f"{type(layer).__name__} layers"
        return static_mlp_unsupported(layer.mlp, self.dtype)

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """transformers' names (self_attn.{q_a_proj, q_a_layernorm, q_b_proj or q_proj,
        kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}, mlp.gate.{weight,
        e_score_correction_bias}, mlp.experts.*, mlp.shared_experts.*); the multi-token-prediction
        layers after the last are left out; with an interleaved rotary (rope_interleave) each
        rotary row pair (2i, 2i + 1) of the query's and the rotary key's rows reordered into halves,
        as `pairs_to_halves` does for other families."""
        own = below_layer(weights, self.config.num_hidden_layers)
        super().load_hf_weights(renamed(self._rotary_in_halves(self._joined_kv_b(own)), _RENAMES))

    def _joined_kv_b(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """kv_b_proj from the two halves llama.cpp's converter splits it into: k_b_proj, each
        head's W_UK transposed [H, rank, nope], and v_b_proj, each head's W_UV [H, v, rank]."""
        cfg = self.config
        halves: dict[tuple[str, str], torch.Tensor] = {}
        for name, t in weights:
            m = re.match(r"^(model\.layers\.\d+\.self_attn\.)(k|v)_b_proj\.weight$", name)
            if m is None:
                yield name, t
                continue
            halves[(m.group(1), m.group(2))] = t
            k, v = halves.get((m.group(1), "k")), halves.get((m.group(1), "v"))
            if k is not None and v is not None:
                H, rank = cfg.num_attention_heads, cfg.mla_kv_lora_rank
                if k.shape != (H, rank, cfg.mla_qk_nope_head_dim) or v.shape != (H, cfg.mla_v_head_dim, rank):
                    raise ValueError(
                        f"{m.group(1)}k_b_proj / v_b_proj: shapes {tuple(k.shape)} / {tuple(v.shape)}, expected "
                        f"{(H, rank, cfg.mla_qk_nope_head_dim)} / {(H, cfg.mla_v_head_dim, rank)}"
                    )
                yield m.group(1) + "kv_b_proj.weight", torch.cat((k.transpose(1, 2), v), dim=1).reshape(-1, rank)
                del halves[(m.group(1), "k")], halves[(m.group(1), "v")]
        if halves:
            raise ValueError(f"k_b_proj / v_b_proj without their other half: {sorted(n + h for n, h in halves)}")

    def _rotary_in_halves(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        cfg = self.config
        nope, rope, rank = cfg.mla_qk_nope_head_dim, cfg.mla_qk_rope_head_dim, cfg.mla_kv_lora_rank
        for name, t in weights:
            if cfg.rope_interleaved and name.endswith(("self_attn.q_b_proj.weight", "self_attn.q_proj.weight")):
                rows = t.reshape(cfg.num_attention_heads, nope + rope, -1)
                rot = rows[:, nope:]
                t = torch.cat((rows[:, :nope], rot[:, 0::2], rot[:, 1::2]), dim=1).reshape(t.shape)
            elif cfg.rope_interleaved and re.search(r"self_attn\.kv_a_proj_with_mqa\.(weight|bias)$", name):
                rot = t[rank:]
                t = torch.cat((t[:rank], rot[0::2], rot[1::2]))
            yield name, t
