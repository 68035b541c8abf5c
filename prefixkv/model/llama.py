"""One decoder covering Llama / SmolLM / Mistral / Qwen2 (qkv bias) / Qwen3 (q/k norm)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .attention import AttentionMetadata, paged_attention, rotate_and_write_kv
from .config import ModelConfig
from .empty_weights import materialize
from .kernels import choice as kernel_choice
from .kernels import gpu_fused, ops
from .kernels.choice import KernelShapes
from .layers import (
    DualLayoutLinear,
    GatedMLP,
    LinearKind,
    NativeLinear,
    PackedLinear,
    RMSNorm,
    RotaryEmbedding,
    TransposedLinear,
    dual_layout_works,
    pack_linears,
    packed_linear_works,
    source_digests,
)
from .moe import SparseMoeBlock, build_mlp, expected_pieces, expert_pieces
from .packed_experts import expert_bytes, pack_experts

logger = logging.getLogger(__name__)

# Attention kernels on CUDA, in torch's order of preference less cuDNN's: cuDNN's fused attention
# (torch's first choice on Hopper) builds an execution plan for every new shape, 1.3 ms of host time
# a call on an H200 with torch 2.11 (bench/profile_decode.py, 2026-11-26), and a decode step's keys
# grow by one every step, so every call was a new shape: 40 ms of a 50 ms step of the default
# model. Flash and memory-efficient attention plan nothing per shape.
CUDA_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class Attention(nn.Module):
    """Layer `layer_idx`'s attention: its window is the config's for that layer (layer_windows);
    `norm` is the q/k norm's class where the config has one."""

    def __init__(self, config: ModelConfig, layer_idx: int = 0, norm: type[RMSNorm] = RMSNorm) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.attention_output_bias)
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = norm(self.head_dim, config.rms_norm_eps)
            self.k_norm = norm(self.head_dim, config.rms_norm_eps)
        # Granite's attention_multiplier replaces the usual scale
        self.scale = self.head_dim**-0.5 if config.attention_multiplier is None else config.attention_multiplier
        self.window = config.layer_windows[layer_idx]
        self.rotary = layer_idx not in config.nope_layers  # SmolLM3's NoPE layers have none
        self.rotary_dim = config.rotary_dim  # the first dimensions of each head rotate (Phi-3: 3/4)
        self.softcap: float | None = None  # attention logit soft-capping (Gemma 2)
        # each query head's sink logit (gpt-oss), kept in float32 as the softmax takes it
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if config.attention_sinks else None

    def qk_norm_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """The q/k norms' weights and eps where they norm as RMSNorm does in `dtype` (a weight of
        that dtype: GemmaRMSNorm's float32 one in bfloat16 scales in float32 instead), for the
        fused kernel; None without q/k norms."""
        if not self.qk_norm:
            return None
        weights = (self.q_norm.weight, self.k_norm.weight)
        if self.q_norm.eps != self.k_norm.eps or any(w.dtype != dtype for w in weights):
            return None
        return weights[0], weights[1], self.q_norm.eps

    def forward(self, x, cos, sin, kv_cache, meta):
        return self.attend(self.qkv_proj(x), cos, sin, kv_cache, meta)

    def attend(self, qkv, cos, sin, kv_cache, meta):
        """The layer's attention from its q/k/v projection `qkv` [T, q + 2 kv] on: the rotation,
        the K/V write, the attention and the output projection."""
        T = qkv.shape[0]
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        v = qkv[:, k_end:].view(T, self.num_kv_heads, self.head_dim)
        q = qkv[:, :q_end].view(T, self.num_heads, self.head_dim)
        k = qkv[:, q_end:k_end].view(T, self.num_kv_heads, self.head_dim)
        # on a GPU one kernel norms (q/k norms) and rotates q and k in place and writes k, v to the cache
        partial = self.rotary_dim < self.head_dim
        written = (
            self.softcap is None
            and self.sinks is None
            and self.rotary
            and not partial
            and gpu_fused.runs_on(qkv)
            and rotate_and_write_kv(q, k, v, cos, sin, kv_cache, meta, self.window, self.qk_norm_weights(qkv.dtype))
        )
        if not written and not self.rotary:
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
        elif not written and partial:  # the rotating dimensions in place in qkv (this layer's own)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
                qk = torch.cat((q, k), dim=1)
            else:
                qk = qkv[:, :k_end].view(T, -1, self.head_dim)
            rot = qk[..., : self.rotary_dim]
            rot.copy_(RotaryEmbedding.apply(rot, cos, sin))
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        elif not written and self.qk_norm:  # the norms' outputs are this layer's own: rotated in place
            q = RotaryEmbedding.apply_(self.q_norm(q), cos, sin)
            k = RotaryEmbedding.apply_(self.k_norm(k), cos, sin)
        elif not written:  # q and k side by side in each row of qkv: one rotation (in place on CPU)
            qk = RotaryEmbedding.apply_(qkv[:, :k_end].view(T, -1, self.head_dim), cos, sin)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        o = paged_attention(
            q, k, v, kv_cache, meta, self.scale, self.window, self.softcap, kv_written=written, sinks=self.sinks
        )
        return self.o_proj(o.reshape(T, self.q_size))


class ProjectionNormedAttention(Attention):
    """Attention with q and k each normed over its whole projection, every head at once before the
    split into heads (OLMo 2, MiniMax-M2), by norms of class `norm`."""

    def __init__(self, config: ModelConfig, layer_idx: int = 0, norm: type[RMSNorm] = RMSNorm) -> None:
        super().__init__(config, layer_idx)
        if config.qk_norm:
            raise ValueError(f"{config.architecture}: q/k norms per head and over the whole projection both")
        self.q_norm = norm(self.q_size, config.rms_norm_eps)
        self.k_norm = norm(self.kv_size, config.rms_norm_eps)

    def attend(self, qkv, cos, sin, kv_cache, meta):
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        qkv = torch.cat((self.q_norm(qkv[:, :q_end]), self.k_norm(qkv[:, q_end:k_end]), qkv[:, k_end:]), dim=-1)
        return super().attend(qkv, cos, sin, kv_cache, meta)


class DecoderLayer(nn.Module):
    """Attention and MLP, each after an RMSNorm (of class `norm`), each added to the residual
    stream; the MLP dense or routed experts by the config (moe.py), or a family's own (`mlp`)."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int = 0,
        norm: type[RMSNorm] = RMSNorm,
        mlp: nn.Module | None = None,
        attention: Callable[[ModelConfig, int], nn.Module] = Attention,
    ) -> None:
        super().__init__()
        self.input_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention(config, layer_idx)
        self.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.mlp = build_mlp(config, layer_idx) if mlp is None else mlp

    def forward(self, h, x, cos, sin, kv_cache, meta, next_norm: RMSNorm):
        """h: the residual stream, x: this layer's normed input (input_layernorm(h), computed by
        the previous layer). Returns the new stream and `next_norm` of it - each residual add
        fused with the norm after it (RMSNorm.add_and_norm)."""
        h, x = self.post_attention_layernorm.add_and_norm(h, self.self_attn(x, cos, sin, kv_cache, meta))
        return next_norm.add_and_norm(h, self.mlp(x))


# layer weights up to this size keep a second layout (DualLayoutLinear) on any machine: 2 GiB
# (~500M parameters in float32, ~1B in bfloat16) doubled; larger ones, for the native decode
# kernel, where the second copy takes at most DUAL_LAYOUT_MEMORY_SHARE of the memory still
# available (a 1B model in float32 decodes 1.46x faster with it on an AMD Zen 4: the oneDNN layout
# streams the weights slower than the native kernel); else one copy, packed for oneDNN (PackedLinear)
DUAL_LAYOUT_MAX_BYTES = 2 << 30
DUAL_LAYOUT_MEMORY_SHARE = 1 / 3


def memory_available_bytes() -> int | None:
    """What the kernel says could be allocated without swapping (Linux's MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def keeps_two_layouts(layer_bytes: int, native_kernel: bool) -> bool:
    """Whether layer weights of this size may keep a second copy (DualLayoutLinear). Past the
    fixed bound only for the native decode kernel: float32's other second kernel, F.linear at 1-2
    rows, lost to oneDNN's packed one on a 1B model's products (7.0 against 5.2 ms at one row)."""
    if layer_bytes <= DUAL_LAYOUT_MAX_BYTES:
        return True
    available = memory_available_bytes()
    return native_kernel and available is not None and layer_bytes <= DUAL_LAYOUT_MEMORY_SHARE * available


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def static_mlp_unsupported(mlp: nn.Module, dtype: torch.dtype) -> str | None:
    """Why a layer's MLP cannot run over fixed buffers: None for a dense one, or routed experts
    where torch._grouped_mm routes them on the device (moe.Experts.grouped_works: asked before any
    capture)."""
    if isinstance(mlp, SparseMoeBlock):
        if not mlp.experts.grouped_works():
            return f"routed experts: no torch._grouped_mm for {dtype} here"
        return None
    if not isinstance(mlp, GatedMLP):
        return f"{type(mlp).__name__} MLPs"
    return None


class LlamaModel(nn.Module):
    """forward(input_ids [T], positions [T], kv_caches, meta) -> final-normed hidden [T, H]."""

    lm_head: nn.Linear | None  # None: tied to the embedding, or laid out in packed_head
    # whether the layers are DecoderLayer's, which the fused decode kernel computes (_DecodeLayers)
    fused_decode_layout = True
    # whether the forward runs some layers for `AttentionMetadata.output_rows` alone (Gemma 4's
    # KV-shared layers): the runner names those rows only for such a model
    reads_output_rows = False

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        self.config = config
        with torch.device("meta"):
            # `_weight` skips Embedding's normal_() init, which on the meta device goes through
            # torch._refs and imports torch._dynamo: 1-2.5 s of every engine start for nothing
            self.embed_tokens = nn.Embedding(
                config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
            )
            self.layers = nn.ModuleList(self.make_layer(config, i) for i in range(config.num_hidden_layers))
            self.norm = self.make_norm(config.hidden_size, config.rms_norm_eps)
            if not config.tie_word_embeddings:
                self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        materialize(self, device, dtype)
        self.to(dtype)
        for m in self.modules():  # a router's selection bias stays float32, as transformers keeps it,
            if isinstance(m, SparseMoeBlock):  # and so does a float32 router's weight (no copy a step)
                if m.expert_bias is not None:
                    m.expert_bias.data = m.expert_bias.data.float()
                if m.logits_float32:
                    m.gate.weight.data = m.gate.weight.data.float()
        if config.tie_word_embeddings:
            self.lm_head = None
        self.rotary = self.make_rotary(config, dtype, device)
        # the sliding layers' own rotary where the config gives them a base (Gemma 3, OLMo 3): unscaled
        self.local_rotary: RotaryEmbedding | None = None
        if config.rope_local_theta is not None and config.any_sliding:
            local = dataclasses.replace(config, rope_theta=config.rope_local_theta, rope_scaling=None)
            self.local_rotary = self.make_rotary(local, dtype, device)
            if type(self).forward is LlamaModel.forward:  # (which rotates every layer by one table)
                raise ValueError(
                    f"{type(self).__name__} does not give {config.architecture}'s sliding layers their rotary"
                )
        self.dtype = dtype
        self.packed_head: PackedLinear | TransposedLinear | DualLayoutLinear | NativeLinear | None = (
            None  # set by pack_for_cpu
        )
        self.lora_context: Any = None  # set by prefixkv.lora.layers.attach_lora: where a step's LoRA mapping goes
        # every layer of a small decode step in one native call (CPU, after pack_for_cpu; _DecodeLayers)
        self.decode_layers: _DecodeLayers | None = None
        self.fused_decode = True  # False: layer by layer always (tests and benchmarks compare the two)
        # a one-row step's norms and SiLU-and-multiply folded into the products after them, on a GPU
        # (kernels/triton_gemv.py; `one_row_products_unsupported`): set where a card timed it faster
        self.one_row_products = False
        self._one_row_unsupported: str | None | bool = False  # False: not asked yet

    def make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        """Decoder layer `layer_idx` (a family with another block overrides this)."""
        return DecoderLayer(config, layer_idx)

    def make_rotary(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> RotaryEmbedding:
        """The rotary table over the part of each head that rotates (`rotary_dim`: the whole head
        unless the config's partial_rotary_factor says less): transformers' base ** (-2i / rotary_dim)."""
        if config.rotary_dim != config.head_dim:
            config = dataclasses.replace(config, head_dim=config.rotary_dim)
        return RotaryEmbedding(config, dtype, device)

    def make_norm(self, dim: int, eps: float) -> RMSNorm:
        """The final norm (a family with another norm overrides this)."""
        return RMSNorm(dim, eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The residual stream's start: the tokens' embeddings (a family that scales them
        overrides this; the stream is updated in place, so a new tensor)."""
        return self.embed_tokens(input_ids)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    # ------------------------------------------------------------ forward
    def begin_step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        lora_mapping: object | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A forward's checks and the step's LoRA mapping handed over; ids and positions on the
        model's device."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} kv caches, got {len(kv_caches)}")
        if input_ids.shape[0] != meta.num_tokens or positions.shape[0] != meta.num_tokens:
            raise ValueError(
                f"input_ids ({input_ids.shape[0]}) / positions ({positions.shape[0]}) must match "
                f"the {meta.num_tokens} new tokens of the metadata"
            )
        if self.lora_context is not None:
            self.lora_context.mapping = lora_mapping
        elif lora_mapping is not None:
            raise ValueError("a LoRA mapping was passed but no LoRA is attached to this model")
        return input_ids.to(self.device), positions.to(self.device)

    def begin_layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        lora_mapping: object | None,
        inputs_embeds: torch.Tensor | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """For a family with its own forward: `begin_step`, then the residual stream's start
        (`embed`, or a copy of `inputs_embeds`, taken as they are), the step's cos / sin for the
        full layers and for the sliding ones (their own table where the config names one)."""
        input_ids, positions = self.begin_step(input_ids, positions, kv_caches, meta, lora_mapping)
        top = max(meta.seq_lens, default=0)  # positions are below it: no device sync
        full = self.rotary.cos_sin(positions, top)
        local = full if self.local_rotary is None else self.local_rotary.cos_sin(positions, top)
        # the residual stream is updated in place: never the caller's tensor
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds.to(self.device, copy=True)
        return h, full, local

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
        """`lora_mapping`: the step's per-token adapter index (prefixkv.lora.LoRAMapping), None: base.
        `inputs_embeds` [T, H]: the input embeddings to use instead of looking up `input_ids` (a
        multimodal step splices image embeddings in at the placeholder positions)."""
        input_ids, positions = self.begin_step(input_ids, positions, kv_caches, meta, lora_mapping)
        dev = self.device
        # positions are < the longest context of the step (no device sync needed)
        cos, sin = self.rotary.cos_sin(positions, max(meta.seq_lens, default=0))
        if inputs_embeds is None:
            h = self.embed(input_ids)
        else:  # the residual stream is updated in place: never the caller's tensor
            h = inputs_embeds.to(dev, copy=True)
        layers = self.layers
        if self.one_row_products and h.shape[0] == 1 and lora_mapping is None:
            x_one = self._one_row_forward(h, cos, sin, kv_caches, meta)
            if x_one is not None:
                return x_one
        x = cast(DecoderLayer, layers[0]).input_layernorm(h) if len(layers) else self.norm(h)
        fused = self.decode_layers
        # (with LoRA attached, a step without adapters is the base model's: the wrappers add nothing)
        if fused is not None and self.fused_decode and lora_mapping is None and meta.static is None:
            if fused.run(h, x, cos, sin, kv_caches, meta):
                return x
        with sdpa_kernel(CUDA_ATTENTION_BACKENDS) if dev.type == "cuda" else contextlib.nullcontext():
            for i, (layer, cache) in enumerate(zip(layers, kv_caches)):
                next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm
                h, x = layer(h, x, cos, sin, cache, meta.for_layer(i), next_norm)
        return x

    def one_row_products_unsupported(self) -> str | None:
        """Why a one-row step cannot fold its norms and SiLU-and-multiply into its products
        (`_one_row_forward`); None where it can: Llama's own forward, layers and RMSNorms, dense
        SiLU MLPs and projections without bias, adapters or packing, no soft-capped scores."""
        if self.lora_context is not None:  # (attached after the model's first forward, perhaps)
            return "LoRA adapters are attached"
        if self._one_row_unsupported is False:
            self._one_row_unsupported = self._one_row_why_not()
        assert self._one_row_unsupported is not True
        return self._one_row_unsupported

    def _one_row_why_not(self) -> str | None:
        if type(self).forward is not LlamaModel.forward:
            return f"{type(self).__name__} has its own forward"
        if type(self.norm) is not RMSNorm:
            return f"its final norm is {type(self.norm).__name__}"
        for layer in self.layers:
            if type(layer) is not DecoderLayer or type(layer.self_attn) is not Attention:
                return f"{type(layer).__name__} layers"
            attn, mlp = layer.self_attn, layer.mlp
            if type(layer.input_layernorm) is not RMSNorm or type(layer.post_attention_layernorm) is not RMSNorm:
                return "its layers' norms are not RMSNorm's"
            if type(mlp) is not GatedMLP or mlp.gelu:
                return f"{type(mlp).__name__} MLPs"
            if attn.softcap is not None:
                return "soft-capped attention scores"
            if attn.sinks is not None:
                return "attention sinks"
            for proj in (attn.qkv_proj, mlp.gate_up_proj, mlp.down_proj):
                if type(proj) is not nn.Linear or proj.bias is not None:
                    return f"a {type(proj).__name__} projection" + (" with a bias" if proj.bias is not None else "")
        return None

    def _one_row_forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        """A one-row step with each residual add and norm folded into the product after it (q/k/v,
        gate/up) and SiLU-and-multiply into down (gpu_fused.norm_linear, silu_linear): six kernels a
        layer where `forward` runs nine. None where this model or device does not take it."""
        if self.one_row_products_unsupported() is not None or not gpu_fused.runs_on(h):
            return None
        delta: torch.Tensor | None = None  # what the residual stream takes before the next norm
        for i, (layer, cache) in enumerate(zip(self.decoder_layers(), kv_caches)):
            # (one_row_products_unsupported checked every layer's attention and MLP kinds)
            attn, mlp = cast(Attention, layer.self_attn), cast(GatedMLP, layer.mlp)
            norm = layer.input_layernorm
            fused = gpu_fused.norm_linear(h, delta, norm.weight, norm.eps, attn.qkv_proj.weight)
            if fused is None:  # the first layer decides: its shapes are every layer's
                if i == 0:
                    return None
                raise RuntimeError("a one-row step's fused product was refused after its first layer")
            h, qkv = fused
            o = attn.attend(qkv, cos, sin, cache, meta.for_layer(i))
            norm = layer.post_attention_layernorm
            fused = gpu_fused.norm_linear(h, o, norm.weight, norm.eps, mlp.gate_up_proj.weight)
            down = None if fused is None else gpu_fused.silu_linear(fused[1], mlp.down_proj.weight)
            if fused is None or down is None:
                raise RuntimeError("a one-row step's fused product was refused after its first layer")
            h, delta = fused[0], down
        if delta is None:  # no layers
            return self.norm(h)
        return self.norm.add_and_norm(h, delta)[1]

    def reserve_positions(self, n: int) -> None:
        """Build the rotary tables (the sliding layers' own too) for positions below `n` now: a
        captured step keeps reading the tables it was recorded with, so no later step may replace
        them by growing them."""
        for table in (self.rotary, self.local_rotary):
            if table is not None and n > table.max_positions:
                table.cos_sin(torch.zeros(1, dtype=torch.long, device=self.device), n - 1)

    def static_decode_unsupported(self) -> str | None:
        """Why a step of this model cannot run over fixed buffers (static_decode.py,
        static_mixed.py: what a CUDA graph captures); None where it can: the plain decoder layers,
        dense MLPs, or routed experts where torch._grouped_mm routes them on the device
        (moe.Experts.grouped_works: asked here, before any capture)."""
        if type(self).forward is not LlamaModel.forward:
            return f"{type(self).__name__} has its own forward"
        for layer in self.layers:
            why = self.static_layer_unsupported(layer)
            if why is not None:
                return why
        return None

    def static_layer_unsupported(self, layer: nn.Module) -> str | None:
        """Why one layer cannot run over fixed buffers (a family with its own layers overrides
        this)."""
        if type(layer) is not DecoderLayer or type(layer.self_attn) is not Attention:
            return f"{type(layer).__name__} layers"
        if layer.self_attn.sinks is not None:
            return "attention sinks (no Triton kernel takes them)"
        return static_mlp_unsupported(layer.mlp, self.dtype)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of final-normed `hidden`, soft-capped where the config says (Gemma 2, Gemma 4)."""
        if self.packed_head is not None:
            logits = self.packed_head(hidden)
        else:
            logits = F.linear(hidden, self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight)
        cap = self.config.final_logit_softcapping
        if cap is not None:  # in transformers' order: divide, tanh, multiply
            logits = torch.tanh(logits / cap) * cap
        return logits

    def kernel_shapes(self) -> KernelShapes:
        """What of this model decides the native kernels' speed (kernel_choice)."""
        return KernelShapes.of(self.config, self.dtype)

    def decoder_layers(self) -> list[DecoderLayer]:
        """The decoder layers, typed (ModuleList indexing gives a plain Module)."""
        return cast("list[DecoderLayer]", list(self.layers))

    def pack_for_cpu(self) -> bool:
        """On CPU, lay every matmul weight out once for the fastest kernel: two layouts, the kernel
        chosen by the step's rows (DualLayoutLinear: oneDNN-packed for many rows; for a decode
        step's few the native small-batch kernel, or float32 F.linear where the CPU has none), or
        one where a second copy of the weights would not fit (`keeps_two_layouts`) or the CPU has no
        second kernel (oneDNN-packed, PackedLinear; float32 transposed for MKL, TransposedLinear,
        where this torch has no oneDNN). Returns whether it did; a no-op elsewhere, when already
        done, or where this torch/CPU cannot."""
        if self.device.type != "cpu" or self.packed_head is not None:
            return False
        if self.dtype in (torch.float32, torch.bfloat16):
            kernel_choice.warn_if_bfloat16_is_emulated(self.dtype)
            kernel_choice.choose(self.kernel_shapes())  # before the layouts: they follow the choice
        kind: LinearKind
        head_kind: LinearKind
        linears = [m for m in self.layers.modules() if isinstance(m, nn.Linear)]
        layer_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
        native_kernel = ops.small_linear_available(self.dtype)
        dual = dual_layout_works(self.dtype) and keeps_two_layouts(layer_bytes, native_kernel)
        # routed experts (packed_experts.py, where their layout times faster) keep a second copy
        # only where the dense layers' and theirs both fit; else oneDNN's layout alone (gpt-oss-20b's
        # gate/up, float32, Zen 2: 3.3 against F.linear's 4.2 ms at one row, 15.7 against 26.3 at 60)
        experts = expert_bytes(self.layers)
        experts_dual = dual and keeps_two_layouts(layer_bytes + experts, native_kernel)
        if experts and dual and not experts_dual:
            logger.info(
                "routed experts' weights (%.1f GB) in one layout (oneDNN's): a second would not fit", experts / 1e9
            )
        if ops.blocked_linear_faster(self.dtype) or (ops.blocked_linear_available(self.dtype) and not dual):
            # one copy, the native layout, for prefill and decode: the blocked kernel timed at least
            # as fast as oneDNN's on this model's products here, or within the tolerance where a
            # second copy would not fit (kernel_choice)
            logger.info(
                "matmul weights (%.1f GB) in one layout, the native kernels' (prefill and decode alike)",
                layer_bytes / 1e9,
            )
            self._pack_linears(NativeLinear, NativeLinear, NativeLinear)
            return True
        if layer_bytes > DUAL_LAYOUT_MAX_BYTES and native_kernel and dual_layout_works(self.dtype):  # memory decided
            available = memory_available_bytes()
            logger.info(
                "layer weights %.1f GB, %.1f GB of memory available: %s",
                layer_bytes / 1e9,
                (available or 0) / 1e9,
                "kept in two layouts (oneDNN's for prefill, the native decode kernel's)"
                if dual
                else "one layout (oneDNN's); a second, for the native decode kernel, would take more than "
                f"{DUAL_LAYOUT_MEMORY_SHARE:.0%} of it",
            )
        if self.dtype == torch.float32:
            # the head (vocabulary x hidden) oneDNN-packed, faster than MKL's F.linear at every
            # batch size measured; at a decode step's rows only the native kernel beats it (1.1-1.4x).
            # One layout alone: oneDNN-packed too. On Llama 3.2 1B's products it beat MKL's
            # transposed layout 1.1-1.3x at 1 and 478 rows and 1.9-4x at 8 (docs/benchmarks.md)
            packed = packed_linear_works(self.dtype)
            kind = DualLayoutLinear if dual else PackedLinear if packed else TransposedLinear
            native_head = dual and native_kernel
            head_kind = DualLayoutLinear if native_head else PackedLinear if packed else TransposedLinear
        elif self.dtype == torch.bfloat16 and packed_linear_works(self.dtype):
            # the head too: at 1-16 rows the native kernel reads its 57 MB 1.0-1.5x faster
            kind = head_kind = DualLayoutLinear if dual else PackedLinear
        else:
            return False
        self._pack_linears(kind, head_kind, kind if experts_dual or kind is not DualLayoutLinear else PackedLinear)
        return True

    def _pack_linears(self, kind: LinearKind, head_kind: LinearKind, experts_kind: LinearKind) -> None:
        pack_linears(self.layers, kind)
        pack_experts(self.layers, experts_kind)  # each routed expert's products (packed_experts.py)
        self.decode_layers = _DecodeLayers.of(self)
        if self.lm_head is None:  # tied: the embedding keeps its own (gather) layout
            self.packed_head = head_kind(self.embed_tokens.weight)
        else:
            self.packed_head = head_kind(self.lm_head.weight)
            # the head's weights stay identifiable under their own name (namespace.weights_digest)
            self.packed_head.source_digests = source_digests(self.lm_head.weight, None)
            self.packed_head.source_name = "lm_head"
            self.lm_head = None  # its only use is compute_logits, which now takes packed_head

    # ------------------------------------------------------------ weights
    def init_random_weights(self, seed: int = 0, std: float = 0.02) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.copy_(torch.randn(p.shape, generator=g) * std)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (model.layers.N.self_attn.q_proj.weight, ...), fusing q/k/v and
        gate/up (a checkpoint's own fused gate_up_proj, gate rows first, is taken whole). Raises
        ValueError on unknown names, shape mismatches or missing tensors."""
        cfg = self.config
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def put(target: str, t: torch.Tensor, rows: tuple[int, ...] | None = None, src: str = "") -> None:
            """rows: (start, end) of a 2-D parameter, (e, start, end) of expert e's matrix, (e,)
            all of expert e, None: the whole parameter."""
            if target not in params:
                raise ValueError(f"checkpoint tensor {src!r} has no place in {cfg.architecture}")
            p = params[target]
            if rows is None:
                dst = p.data
            elif len(rows) == 1:
                dst = p.data[rows[0]]
            elif len(rows) == 2:
                dst = p.data[rows[0] : rows[1]]
            else:
                dst = p.data[rows[0], rows[1] : rows[2]]
            if tuple(dst.shape) != tuple(t.shape):
                raise ValueError(
                    f"shape mismatch for {src!r}: checkpoint {tuple(t.shape)}, expected {tuple(dst.shape)}"
                )
            dst.copy_(t.to(dtype=dst.dtype))
            loaded.add(f"{target}[{rows}]")

        for name, t in weights:
            if name.startswith("model.") and not name.startswith("model.layers."):
                sub = name[len("model.") :]
                if sub in params:  # the embedding, the final norm, a family's own (Gemma 4's per-layer inputs)
                    put(sub, t, src=name)
                    continue
            if name == "lm_head.weight":
                if cfg.tie_word_embeddings:
                    continue  # tied: the embedding is used
                put("lm_head.weight", t, src=name)
                continue
            m = _LAYER_RE.match(name)
            if not m:
                if "rotary_emb" in name:
                    continue
                raise ValueError(f"unexpected checkpoint tensor {name!r}")
            i, rest = m.group(1), m.group(2)
            pre = f"layers.{i}."
            if rest.startswith("block_sparse_moe."):  # Mixtral's name for the MoE MLP
                rest = "mlp." + rest[len("block_sparse_moe.") :]
            pieces = expert_pieces(rest, t, cfg, int(i))
            if pieces is not None:
                for target, rows, piece in pieces:
                    put(pre + target, piece, rows, name)
                continue
            kind = rest.rsplit(".", 1)[-1]  # weight / bias
            if cfg.rope_interleaved and rest.startswith(("self_attn.q_proj.", "self_attn.k_proj.")):
                t = pairs_to_halves(t, cfg.head_dim, cfg.rotary_dim)
            projection = rest.split(".")[1] if rest.startswith("self_attn.") else ""
            qkv_rows = self._qkv_rows(int(i))
            if projection in qkv_rows:
                put(pre + "self_attn.qkv_proj." + kind, t, qkv_rows[projection], name)
            elif rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
                I = self._dense_intermediate(int(i))
                put(pre + "mlp.gate_up_proj.weight", t, (0, I) if "gate" in rest else (I, 2 * I), name)
            elif rest.endswith("gate_up_proj.weight"):  # fused as this model holds it: gate rows, then up
                half = t.shape[0] // 2
                put(pre + rest, t[:half], (0, half), name)
                put(pre + rest, t[half:], (half, 2 * half), name)
            else:
                put(pre + rest, t, src=name)

        expected: set[str] = set()
        for n in params:
            if n.endswith("qkv_proj.weight") or n.endswith("qkv_proj.bias"):
                expected |= {f"{n}[{r}]" for r in self._qkv_rows(int(n.split(".")[1])).values()}
            elif n.endswith("gate_up_proj.weight"):
                half = params[n].shape[0] // 2  # the dense MLP's or a shared expert's
                expected |= {f"{n}[{r}]" for r in [(0, half), (half, 2 * half)]}
            elif (indices := expected_pieces(n, params[n])) is not None:
                expected |= {f"{n}[{r}]" for r in indices}
            else:
                expected.add(f"{n}[None]")
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")

    def _qkv_rows(self, layer: int) -> dict[str, tuple[int, int]]:
        """Where each of layer `layer`'s q/k/v projections goes in its fused qkv_proj: its
        attention's own rows (`projection_rows`), or the config's q, k, v sizes."""
        attention = getattr(self.layers[layer], "self_attn", None)
        rows = getattr(attention, "projection_rows", None)
        if rows is not None:
            return rows()
        cfg = self.config
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        return {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}

    def _dense_intermediate(self, layer: int) -> int:
        """Layer `layer`'s dense MLP width (Gemma 4's KV-shared layers may have twice the config's)."""
        mlp = getattr(self.layers[layer], "mlp", None)
        return mlp.intermediate if isinstance(mlp, GatedMLP) else self.config.intermediate_size


def renamed(
    weights: Iterable[tuple[str, torch.Tensor]], renames: Iterable[tuple[re.Pattern[str], str]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under a family's names for them: each (pattern, replacement) of
    `renames` applied to every name in turn."""
    renames = tuple(renames)
    for name, tensor in weights:
        for pattern, to in renames:
            name = pattern.sub(to, name)
        yield name, tensor


def below_layer(weights: Iterable[tuple[str, torch.Tensor]], n: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors less those of layers `n` and on: a family's multi-token-prediction
    blocks, which its checkpoints append after the last decoder layer (GLM-4.5, MiniMax-M2) and
    which are not the model's (transformers and vLLM leave them out too)."""
    for name, tensor in weights:
        m = _LAYER_RE.match(name)
        if m is None or int(m.group(1)) < n:
            yield name, tensor


def pairs_to_halves(t: torch.Tensor, head_dim: int, rotary_dim: int) -> torch.Tensor:
    """q or k projection rows (or biases) [heads * head_dim, ...] with each head's rotating rows
    reordered from pairs (2i, 2i + 1: an interleaved rotary's) to halves (i, i + rotary_dim / 2:
    the rotary computed here). Attention reads q . k, which the same reordering of both leaves as
    it was (up to the order of the sum), and v is not reordered."""
    heads = t.shape[0] // head_dim
    rows = t.reshape(heads, head_dim, *t.shape[1:])
    rotating = rows[:, :rotary_dim]
    reordered = torch.cat((rotating[:, 0::2], rotating[:, 1::2], rows[:, rotary_dim:]), dim=1)
    return reordered.reshape(t.shape)


class _DecodeLayers:
    """Every decoder layer of a decode step in one native call (ops.decode_layers,
    csrc/decode_layers.cpp): at one to a few sequences the layer-by-layer path spends as much time
    in Python dispatch and per-piece thread start-up as in streaming the weights. The same kernels'
    own pieces compute every value, so its results are the layer-by-layer path's bit for bit.

    Built once by `LlamaModel.pack_for_cpu` where the model's shape allows (`of`); `run` takes a
    step only when every new token is a decode, at most `max_rows` of them (sequences sharing
    leading blocks included: with the native decode kernel such a step has no cascade, _Plan)."""

    def __init__(self, model: LlamaModel) -> None:
        cfg = model.config
        layers = model.decoder_layers()
        rows = []
        self._keep: list[torch.Tensor] = []  # what the addresses point into
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.norm
            # `of` checked that every one has the native layout
            qkv, o, gate_up, down = (
                cast(DualLayoutLinear | NativeLinear, m)
                for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            )
            parts = [qkv.small, qkv.small_bias, o.small, gate_up.small, down.small]
            parts += [layer.post_attention_layernorm.weight.data, next_norm.weight.data]
            self._keep += [t for t in parts if t is not None]
            rows.append([0 if t is None else t.data_ptr() for t in parts])
        self.weights = torch.tensor(rows, dtype=torch.int64)
        self.dtype = model.dtype
        self.shape = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.intermediate = cfg.intermediate_size
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.head_dim**-0.5  # Attention.scale
        self.max_rows = ops.small_linear_max_rows(model.dtype)
        self._caches: list[int] = []  # the addresses of the caches last checked, and as a tensor
        self._caches_tensor = torch.zeros(0, dtype=torch.int64)

    @staticmethod
    def of(model: LlamaModel) -> _DecodeLayers | None:
        """The fused path for `model`, or None where its shape is not what the kernel takes: every
        layer matmul in the small-batch layout (NativeLinear, or DualLayoutLinear with the native kernel), no q/k
        norm, no sliding window, no bias but q/k/v's, the attention kernel's head dims and groups,
        one norm epsilon."""
        cfg = model.config
        if not len(model.layers) or not ops.decode_layers_available(model.dtype):
            return None
        if not model.fused_decode_layout or cfg.qk_norm or cfg.any_sliding or cfg.attention_sinks or cfg.nope_layers:
            return None
        if cfg.rotary_dim != cfg.head_dim:  # the kernel rotates whole heads
            return None
        if cfg.head_dim not in ops.HEAD_DIMS:
            return None
        Hq, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        if Hq % Hkv or Hq // Hkv > ops.MAX_GROUP:
            return None
        for layer in model.decoder_layers():
            if not isinstance(layer.mlp, GatedMLP):  # routed experts: layer by layer (moe.py)
                return None
            attn = layer.self_attn
            if type(attn) is not Attention:  # a family's own attention (latent attention)
                return None
            linears = (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            if not all(isinstance(m, (DualLayoutLinear, NativeLinear)) and m.small is not None for m in linears):
                return None
            if any(m.bias is not None for m in linears[1:]):
                return None
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(n.eps != cfg.rms_norm_eps or n.weight.dtype != model.dtype for n in norms):
                return None
        if model.norm.eps != cfg.rms_norm_eps or model.norm.weight.dtype != model.dtype:
            return None
        return _DecodeLayers(model)

    def _cache_addresses(self, kv_caches: list[torch.Tensor]) -> torch.Tensor | None:
        """The caches' addresses as a tensor (checked once per set of caches): every one contiguous,
        of the model's dtype and the first one's shape."""
        addresses = [c.data_ptr() for c in kv_caches]
        if addresses != self._caches:
            first = kv_caches[0]
            if any(c.dtype != self.dtype or not c.is_contiguous() or c.shape != first.shape for c in kv_caches):
                return None
            self._caches = addresses
            self._caches_tensor = torch.tensor(addresses, dtype=torch.int64)
        return self._caches_tensor

    def run(
        self,
        h: torch.Tensor,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> bool:
        """The step's layers on h (the residual stream, in place) and x (its first normed input,
        the final norm's output on return). False where the step is not for this path (nothing
        changed then)."""
        B = meta.num_tokens
        if B == 0 or B > self.max_rows or h.device.type != "cpu":
            return False
        cache = kv_caches[0]
        H, Hq, Hkv, D = self.shape
        if cache.dim() != 5 or cache.shape[0] != 2 or cache.shape[3:] != (Hkv, D):
            return False
        plan = meta.plan(cache.shape[2], cache.device, None, self.dtype)
        # (a cascade, prefix_slots, is planned only where the decode kernel is off: _Plan; Triton's
        # kernels, forced on a CPU under its interpreter, take the step's attention instead)
        if plan.triton or not plan.decode_all or plan.decode_rows is None or plan.prefix_slots is not None:
            return False
        addresses = self._cache_addresses(kv_caches)
        if addresses is None:
            return False
        slots, lens = plan.decode_slots.contiguous(), plan.decode_lens.contiguous()
        dims = torch.tensor(
            [B, H, Hq, Hkv, D, self.intermediate, slots.shape[1], len(kv_caches), cache[0].numel()], dtype=torch.int64
        )
        return ops.decode_layers(
            dims,
            self.weights,
            addresses,
            h,
            x,
            cos.contiguous(),
            sin.contiguous(),
            plan.slot_mapping.contiguous(),
            slots,
            lens,
            self.eps,
            self.scale,
        )
