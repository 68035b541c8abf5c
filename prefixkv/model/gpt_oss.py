"""gpt-oss (OpenAI's open-weight mixture-of-experts models): the Llama decoder's layer with
biased q/k/v and output projections, a learned sink logit per query head in every softmax
(model/explicit_attention.py), sliding and full layers interleaved, YaRN rotary, float32-scaled
norms, and routed experts of their own kind: the router a biased linear whose top-k logits are
softmaxed (in the logits' dtype), each expert a biased gate/up and down with gpt-oss's clamped
SwiGLU, (up + 1) * gate * sigmoid(alpha * gate) after gate <= limit and -limit <= up <= limit.

The checkpoints keep the experts either as transformers lays them out (gate_up_proj [E, H, 2I]
with gate and up interleaved column by column, down_proj [E, I, H]) or in MXFP4, OpenAI's
release format: `*_blocks` of two 4-bit values a byte and `*_scales` of one power-of-two
exponent per 32 values (dequantized at load, as transformers' convert_moe_packed_tensors
does). Either is laid out once here as [E, 2I, H] (gate rows first) and [E, H, I]."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import Float32RMSNorm, RMSNorm, keep_float32_norms
from .llama import DecoderLayer, LlamaModel
from .moe import ExpertProducts, Projection, route

# MXFP4's 4-bit values (e2m1), by code: the sign in the top bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_SCALE_BIAS = 127  # a scale byte s means 2 ** (s - 127)


class GptOssExperts(nn.Module):
    """The routed experts: gate_up_weight [E, 2I, H] (gate rows first), gate_up_bias [E, 2I],
    down_weight [E, H, I], down_bias [E, H]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts, self.intermediate = E, I
        self.limit, self.alpha = config.swiglu_limit, config.swiglu_alpha
        self.gate_up_weight = nn.Parameter(torch.empty(E, 2 * I, H))
        self.gate_up_bias = nn.Parameter(torch.empty(E, 2 * I))
        self.down_weight = nn.Parameter(torch.empty(E, H, I))
        self.down_bias = nn.Parameter(torch.empty(E, H))

    def forward(self, x: torch.Tensor, top_index: torch.Tensor, top_weight: torch.Tensor) -> torch.Tensor:
        """x [T, H], top_index / top_weight [T, k] -> [T, H] (moe.route: the pairs sorted by expert)."""
        return route(x, top_index, top_weight, self.num_experts, self._one)

    def _one(self, rows: torch.Tensor, e: int) -> torch.Tensor:
        gate_up = F.linear(rows, self.gate_up_weight[e], self.gate_up_bias[e])
        return F.linear(self.activation(gate_up), self.down_weight[e], self.down_bias[e])

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        return clamped_swiglu(gate_up, self.intermediate, self.limit, self.alpha)

    def expert_products(self, count: int | None = None) -> ExpertProducts:
        """What each expert computes (the first `count` alone), for a layout of its own
        (model/packed_experts.py)."""
        activation = functools.partial(
            clamped_swiglu, intermediate=self.intermediate, limit=self.limit, alpha=self.alpha
        )
        return ExpertProducts(
            self.gate_up_weight[:count], self.down_weight[:count], self.gate_up_bias[:count],
            self.down_bias[:count], activation,
        )  # fmt: skip


def clamped_swiglu(gate_up: torch.Tensor, intermediate: int, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU over [rows, 2I] (gate columns first) -> [rows, I], in transformers'
    order of operations."""
    gate, up = gate_up.split(intermediate, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssMoe(nn.Module):
    """The MLP of every gpt-oss layer: forward(x [T, H]) -> [T, H]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = Projection(config.num_experts, config.hidden_size, bias=True)
        self.experts = GptOssExperts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_logits, top_index = torch.topk(self.router(x), self.top_k, dim=-1)
        top_weight = torch.softmax(top_logits, dim=-1, dtype=top_logits.dtype)
        return self.experts(x, top_index, top_weight)


class GptOssModel(LlamaModel):
    """forward(input_ids [T], positions [T], kv_caches, meta) -> final-normed hidden [T, H]."""

    fused_decode_layout = False  # the fused decode kernel has no sinks, output bias or experts

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> None:
        if config.architecture != "GptOssForCausalLM" or not config.num_experts or not config.attention_sinks:
            raise ValueError(f"GptOssModel does not build {config.architecture} without experts and sinks")
        super().__init__(config, dtype=dtype, device=device)
        keep_float32_norms(self)
        for layer in self.decoder_layers():
            sinks = layer.self_attn.sinks
            assert sinks is not None
            sinks.data = sinks.data.float()  # read in float32 by the softmax (explicit_attention.py)

    def make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return DecoderLayer(config, layer_idx, norm=Float32RMSNorm, mlp=GptOssMoe(config))

    def make_norm(self, dim: int, eps: float) -> RMSNorm:
        return Float32RMSNorm(dim, eps)

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As LlamaModel's, with the experts laid out here (`expert_tensors`)."""
        super().load_hf_weights(expert_tensors(weights, self.config.moe_intermediate_size))


# ------------------------------------------------------------------ checkpoint layouts
_EXPERT_TENSOR = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
# a GGUF file's gate and up matrices (or biases) apart, [E, I, ...] each (loader.gguf_to_hf_name)
_GATE_OR_UP = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(gate|up)_(weight|bias)$")


def expert_tensors(
    weights: Iterable[tuple[str, torch.Tensor]], intermediate: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each expert tensor in GptOssExperts' layout and name: MXFP4
    blocks and scales (held until both of a matrix are read) dequantized, transformers' [E, H, 2I]
    and [E, I, H] transposed, gate and up de-interleaved, a GGUF file's separate gate and up (held
    until both are read) joined. Every other tensor passes as it is."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in weights:
        m = _EXPERT_TENSOR.match(name)
        if m is None:
            halves = _GATE_OR_UP.match(name)
            if halves is None:
                yield name, t
                continue
            prefix, half, kind = halves.groups()
            parts = pending.setdefault(prefix + "gate_up_" + kind, {})
            parts[half] = t
            if len(parts) == 2:
                del pending[prefix + "gate_up_" + kind]
                yield prefix + "gate_up_" + kind, torch.cat((parts["gate"], parts["up"]), dim=1)
            continue
        prefix, matrix, suffix = m.group(1), m.group(2), m.group(3) or ""
        if suffix in ("_blocks", "_scales"):
            parts = pending.setdefault(prefix + matrix, {})
            parts[suffix] = t
            if len(parts) < 2:
                continue
            del pending[prefix + matrix]
            w = dequantize_mxfp4(parts["_blocks"], parts["_scales"])  # [E, out, in]
        elif suffix == "_bias":
            bias = t if matrix == "down_proj" else _gate_rows_first(t, intermediate)
            yield prefix + matrix.replace("_proj", "_bias"), bias
            continue
        else:
            w = t.transpose(1, 2)  # transformers' [E, in, out]
        if matrix == "gate_up_proj":
            w = _gate_rows_first(w, intermediate)
        yield prefix + matrix.replace("_proj", "_weight"), w
    if pending:
        raise ValueError(f"expert tensors without their other half (blocks or scales, gate or up): {sorted(pending)}")


def _gate_rows_first(t: torch.Tensor, intermediate: int) -> torch.Tensor:
    """[E, 2I, ...] with gate and up interleaved along dim 1 -> the I gate rows, then the I up rows."""
    if t.shape[1] != 2 * intermediate:
        raise ValueError(f"expert gate/up tensor of shape {tuple(t.shape)}: expected {2 * intermediate} rows")
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 `blocks` [..., G, 16] (uint8: the low nibble the even value, the high one the odd)
    and `scales` [..., G] (uint8 exponents) -> [..., G * 32] values in `dtype`: each group of 32
    values times 2 ** (scale - 127). Exact: every value and scale is a power of two times a
    small integer."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} {scales.dtype}: "
            "expected uint8 blocks [..., G, 16] and uint8 scales [..., G]"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = torch.empty(*blocks.shape[:-1], blocks.shape[-1] * 2, dtype=torch.float32)
    values[..., 0::2] = lut[(blocks & 0x0F).long()]
    values[..., 1::2] = lut[(blocks >> 4).long()]
    exponents = scales.to(torch.int32) - MXFP4_SCALE_BIAS
    values = torch.ldexp(values, exponents.unsqueeze(-1))
    return values.reshape(*blocks.shape[:-2], -1).to(dtype)
