"""Basic layers: RMSNorm, rotary embedding, gated SiLU MLP, and CPU-packed linear layers."""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import nn

from . import row_split
from .config import ModelConfig
from .kernels import calls, gpu_fused, ops, reference


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = ops.add_rms_norm(x, None, self.weight, self.eps)  # one native pass on CPU
        if out is None:
            out = gpu_fused.add_rms_norm(x, None, self.weight, self.eps)  # one Triton kernel on a GPU
        if out is not None:
            return out
        if x.dtype == torch.float32:
            return F.rms_norm(x, (self.dim,), self.weight, self.eps)
        # Normalize in float32, scale in the model dtype (as transformers does).
        return self.weight * F.rms_norm(x.float(), (self.dim,), None, self.eps).to(x.dtype)

    def add_and_norm(self, h: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, the norm of it) - the residual stream and the next sublayer's input. Where
        the native kernel runs (CPU) both come from one pass and h is updated in place: pass a
        tensor the model owns."""
        out = ops.add_rms_norm(h, delta, self.weight, self.eps)
        if out is None:
            out = gpu_fused.add_rms_norm(h, delta, self.weight, self.eps)
        if out is not None:
            return h, out
        h = h + delta
        return h, self(h)


class Float32RMSNorm(RMSNorm):
    """An RMSNorm whose weight stays float32 in every model dtype and scales in float32 before the
    cast back, as transformers' Gemma and gpt-oss norms compute (the model keeps the weight
    float32 after its cast: `keep_float32_norms`). In float32 it is RMSNorm, native kernel
    included."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:
            return super().forward(x)
        return F.rms_norm(x.float(), (self.dim,), self.weight, self.eps).to(x.dtype)

    def add_and_norm(self, h: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if h.dtype == self.weight.dtype:
            return super().add_and_norm(h, delta)
        h = h + delta
        return h, self(h)


def keep_float32_norms(model: nn.Module) -> None:
    """Every Float32RMSNorm's weight of `model` back in float32 (after the model's cast)."""
    for m in model.modules():
        if isinstance(m, Float32RMSNorm):
            m.weight.data = m.weight.data.float()


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in float32, with optional linear / llama3 / YaRN / LongRoPE
    (its short factors) / proportional scaling (transformers' modeling_rope_utils, step for step)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = config.rope_scaling
    if rs is None:
        return inv_freq
    rtype = rs["rope_type"]
    factor = float(rs.get("factor") or 1.0)
    if rtype == "linear":
        return inv_freq / factor
    if rtype == "llama3":
        low = float(rs["low_freq_factor"])
        high = float(rs["high_freq_factor"])
        old_ctx = float(rs["original_max_position_embeddings"])
        low_wavelen = old_ctx / low
        high_wavelen = old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        inv_l = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, inv_l)
    if rtype == "yarn":
        return _yarn_inv_freq(config, rs, factor)
    if rtype == "proportional":  # Gemma 4: the first share of the angles rotate, the others are 0
        angles = int(float(rs.get("partial_rotary_factor", 1.0)) * d // 2)
        inv_freq[angles:] = 0.0
        return inv_freq / factor
    if rtype == "longrope":  # the short factors (ModelConfig.exact_context)
        short = torch.tensor(rs["short_factor"], dtype=torch.float32)
        if short.shape != inv_freq.shape:
            raise ValueError(f"longrope short_factor has {short.numel()} entries for {inv_freq.numel()} frequencies")
        return 1.0 / (short * config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    raise ValueError(f"Unsupported rope type {rtype!r}")


def _yarn_inv_freq(config: ModelConfig, rs: dict, factor: float) -> torch.Tensor:
    """YaRN: each frequency interpolated (divided by `factor`), kept, or blended between the two
    by a linear ramp over the dimensions whose wavelengths lie between `beta_fast` and
    `beta_slow` rotations of the original context."""
    d, base = config.head_dim, config.rope_theta
    old_ctx = float(rs["original_max_position_embeddings"])
    beta_fast = float(rs.get("beta_fast") or 32)
    beta_slow = float(rs.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (d * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, d, 2).float() / d)
    extrapolation = 1 - ramp  # the share of each frequency kept as it is
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 m ln(scale) + 1 (1 at scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def rope_attention_factor(config: ModelConfig) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor (given, or 0.1 ln(factor) + 1,
    or DeepSeek's ratio of two such with mscale / mscale_all_dim), LongRoPE's (given, or
    sqrt(1 + ln(factor) / ln(original context))); 1 for every other rotary."""
    rs = config.rope_scaling
    if rs is None or rs["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])
    factor = float(rs["factor"])
    if rs["rope_type"] == "longrope":
        original = float(rs["original_max_position_embeddings"])
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
    if m and m_all:
        return float(yarn_mscale(factor, float(m)) / yarn_mscale(factor, float(m_all)))
    return yarn_mscale(factor)


class RotaryEmbedding(nn.Module):
    """Neox/HF-style rotary embedding (rotate_half) with a precomputed cos/sin cache."""

    cos_cache: torch.Tensor  # buffers (register_buffer)
    sin_cache: torch.Tensor

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.max_positions = max(config.max_position_embeddings, 1)
        self.inv_freq = rope_inv_freq(config)
        self.attention_factor = rope_attention_factor(config)
        self._dtype = dtype
        self._build(self.max_positions, device)

    def _build(self, n: int, device) -> None:
        t = torch.arange(n, dtype=torch.int64).float()
        freqs = torch.outer(t, self.inv_freq)  # [n, d/2] float32
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        # computed in float32 and cast, like transformers; full width, the sine signed for
        # rotate_half (see apply), so that a rotation is four whole-row operations
        full_cos = torch.cat((cos, cos), dim=-1)
        signed_sin = torch.cat((-sin, sin), dim=-1)
        self.register_buffer("cos_cache", full_cos.to(self._dtype).to(device), persistent=False)
        self.register_buffer("sin_cache", signed_sin.to(self._dtype).to(device), persistent=False)
        self.max_positions = n

    def cos_sin(self, positions: torch.Tensor, max_position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (-sin on the first half, sin on the second) of shape [T, 1, head_dim]
        for positions [T].

        `max_position` (an upper bound of positions, known from the metadata) avoids a
        device sync; without it the max is read from the tensor."""
        if positions.numel():
            top = int(positions.max()) if max_position is None else max_position
            if top >= self.max_positions:
                self._build(max(top + 1, 2 * self.max_positions), self.cos_cache.device)
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)

    @staticmethod
    def apply_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`apply`, in place in x where the native kernel takes it (on CPU: one pass, no new
        tensor, the same values bit for bit); else a new tensor. Use the result, not x."""
        if ops.rotary_(x, cos, sin) or gpu_fused.rotary_(x, cos, sin):
            return x
        return RotaryEmbedding.apply(x, cos, sin)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """x: [T, H, D] (any strides); cos, signed sin: [T, 1, D] (from cos_sin). Returns a new
        contiguous tensor, transformers' rotation bit for bit (reference.reference_rotary);
        callers rotate q and k together (one call per layer)."""
        return reference.reference_rotary(x, cos, sin)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul; act is SiLU, or with
    activation="gelu_pytorch_tanh" GELU's tanh approximation (GeGLU, Gemma)."""

    def __init__(self, hidden: int, intermediate: int, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported MLP activation {activation!r}")
        self.gelu = activation == "gelu_pytorch_tanh"
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        if self.gelu:
            g, u = gu.split(self.intermediate, dim=-1)
            return self.down_proj(F.gelu(g, approximate="tanh") * u)
        act = ops.silu_and_mul(gu)  # one native pass on CPU
        if act is None:
            act = gpu_fused.silu_and_mul(gu)  # one Triton kernel on a GPU
        if act is None:
            g, u = gu.split(self.intermediate, dim=-1)
            act = F.silu(g) * u
        return self.down_proj(act)


class PackedWeights(nn.Module):
    """A linear layer whose weights live in a kernel's layout; `source_digests` (and, for the
    head, `source_name`) identify the weights it was made from (`source_digests`)."""

    source_digests: dict[str, str]
    source_name: str


class PackedLinear(PackedWeights):
    """x @ W.T (+ b) with W reordered once into oneDNN's blocked layout. For bfloat16 on CPUs with
    AVX512-BF16 / AMX, F.linear re-lays the weight out on every call; packed, a decode step of the
    default model is ~20% faster (docs/benchmarks.md). Only for inference: no gradients."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 8)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        y = row_split.linear(flat, self.weight, self.bias, self.out_features)  # beside a neighbour
        if y is None:
            y = torch.ops.mkldnn._linear_pointwise(flat, self.weight, self.bias, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)


class TransposedLinear(PackedWeights):
    """x @ W.T (+ b) for float32 on CPU with W stored transposed, [in, out] contiguous, and
    multiplied by torch.mm / addmm. MKL's kernels for this layout are faster than F.linear's
    (which multiplies by the [out, in] weight transposed on the fly) at decode-sized batches: on
    this project's machine, one thread, the default model's four layer matmuls take 1.4-1.8x less
    time at 4-16 rows and 1.1-1.2x less at 32-480, but 7-14% more at 1-2 rows (two threads:
    1.2-1.5x less at 4-8 rows, 16-26% more at 1-2; `bench/levers.py`, docs/benchmarks.md). Same
    products and sums, possibly in another order: results equal F.linear's up to float32 rounding.
    Only for inference: no gradients."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight_t = weight.detach().t().contiguous()
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        y = torch.mm(flat, self.weight_t) if self.bias is None else torch.addmm(self.bias, flat, self.weight_t)
        return y.reshape(*x.shape[:-1], self.out_features)


class DualLayoutLinear(PackedWeights):
    """x @ W.T (+ b) on CPU with the weight kept in two layouts and the kernel chosen by the number
    of rows: many rows oneDNN-packed (no per-call repacking of the weight), a decode step's few rows
    a kernel that streams the weight once.

    The few-row kernel is the native `ops.small_linear` where the CPU has it (AVX-512 or AVX2 for
    float32, AVX512-BF16 for bfloat16), up to the rows timed faster here (kernel_choice; at most
    ops.SMALL_LINEAR_MAX_ROWS): on an AMD Zen 4 without AMX
    it beat oneDNN's packed kernel 1.1-2.5x at 1-16 rows in both dtypes, and MKL's F.linear 2-5x in
    float32 (`bench/small_linear.py`, docs/benchmarks.md). Elsewhere float32 takes F.linear on the
    [out, in] weight (MKL's matrix-vector path) up to `SMALL_ROWS` rows: on an Intel Sapphire Rapids
    a decode step of the default model at batch 8 took ~12% less time than with TransposedLinear,
    and ~20% less than packed-only at batch 1 (`bench/model_speed.py --layouts`).

    Costs a second copy of the weights, so `LlamaModel.pack_for_cpu` uses it only below a size
    bound. Only for inference."""

    SMALL_ROWS = 2

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 8)
        self.bias = None if bias is None else bias.detach()
        self.small: torch.Tensor | None = ops.small_linear_weight(weight)
        self.weight: torch.Tensor | None = None
        if self.small is not None:
            self.small_rows = ops.small_linear_max_rows(weight.dtype)  # as timed here (kernel_choice)
            self.small_bias = None if bias is None else bias.detach().float().contiguous()
        else:
            self.small_rows = self.SMALL_ROWS
            # a copy, not the model's original tensor: with that one kept, the packed path ran ~2x
            # slower inside the model (batch 16 decode 96 -> 183 ms; memory placement, cause not
            # pinned down) - measured, so keep it a copy
            self.weight = weight.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        y = None
        if flat.shape[0] <= self.small_rows:
            if self.small is not None:
                y = ops.small_linear(flat, self.small, self.out_features, self.small_bias)
            elif self.weight is not None:
                y = F.linear(flat, self.weight, self.bias)
        else:
            y = row_split.linear(flat, self.packed, self.bias, self.out_features)  # beside a neighbour
        if y is None:
            y = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)


class NativeLinear(PackedWeights):
    """x @ W.T (+ b) on CPU with one copy of the weight, in the native kernels' layout
    (`ops.small_linear_weight`): a decode step's few rows by the small-batch linear (the weight
    streamed once per step), more rows by the blocked one (`ops.blocked_linear`, a prefill's). Both
    sum every output in the same order with the same instructions, so a row's product is the same
    bits whichever kernel ran and however many rows shared the call.

    Kept where the blocked kernel timed at least as fast as oneDNN's on the model's products
    (kernel_choice): half the memory of DualLayoutLinear at the same speed; and, within 5% of it,
    where a second copy would not fit: those models' decode steps on the native kernel (1.4x faster
    than oneDNN's layout alone for Llama 3.2 1B, docs/benchmarks.md). Only for inference."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        small = ops.small_linear_weight(weight)
        if small is None:
            raise ValueError(f"no native linear kernel for {weight.dtype} [{weight.shape[0]}, {weight.shape[1]}] here")
        self.small: torch.Tensor = small
        self.small_rows = ops.small_linear_max_rows(weight.dtype)
        self.bias = None if bias is None else bias.detach()
        self.small_bias = None if bias is None else bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        kernel = ops.small_linear if flat.shape[0] <= self.small_rows else ops.blocked_linear
        y = kernel(flat, self.small, self.out_features, self.small_bias)
        if y is None:  # the kernels switched off after the layout was made (ops.disabled): slow, exact
            weight = calls.small_linear_unlayout(self.small, self.out_features)
            y = F.linear(flat, weight, None if self.bias is None else self.bias.to(flat.dtype))
        return y.reshape(*x.shape[:-1], self.out_features)


def dual_layout_works(dtype: torch.dtype) -> bool:
    """Whether DualLayoutLinear has a second kernel for `dtype` here (the native small-batch kernel;
    in float32 F.linear where there is none) on top of oneDNN's packed one."""
    if not packed_linear_works(dtype):
        return False
    return dtype == torch.float32 or ops.small_linear_available(dtype)


def packed_linear_works(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this torch build and CPU run PackedLinear, and agree with F.linear."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(64, 32, generator=g).to(dtype)
        x = torch.randn(5, 32, generator=g).to(dtype)
        got = PackedLinear(w)(x).float()
    except (RuntimeError, AttributeError):  # op missing from this build, or no kernel for the CPU
        return False
    return bool(torch.allclose(got, F.linear(x, w).float(), rtol=2e-2, atol=2e-2))


LinearKind = type[PackedLinear] | type[TransposedLinear] | type[DualLayoutLinear] | type[NativeLinear]


def tensor_digest(t: torch.Tensor) -> str:
    """xxh3-128 of a tensor's dtype, shape and bytes: what identifies a weight (the KV tiers'
    namespace, prefixkv/tiers/namespace.py)."""
    import xxhash

    h = xxhash.xxh3_128()
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    data = t.detach().contiguous().cpu()
    if data.dtype in (torch.bfloat16, torch.float16):
        data = data.view(torch.int16)
    elif data.dtype.is_floating_point and data.element_size() == 1:
        data = data.view(torch.int8)
    if data.numel():
        h.update(data.reshape(-1).numpy().data)
    return h.hexdigest()


def source_digests(weight: torch.Tensor, bias: torch.Tensor | None) -> dict[str, str]:
    """The digests of the weights a packed layer was made from. A packed layer keeps its weights in
    a kernel's layout, outside the module's parameters (so outside `state_dict()`): these stand for
    them when the model's weights are identified (LlamaModel.weight_digests)."""
    out = {"weight": tensor_digest(weight)}
    if bias is not None:
        out["bias"] = tensor_digest(bias)
    return out


def pack_linears(module: nn.Module, kind: LinearKind = PackedLinear) -> int:
    """Replace every nn.Linear below `module` by a `kind` (PackedLinear, TransposedLinear,
    DualLayoutLinear or NativeLinear), each with the digests of the weights it replaces (`source_digests`);
    returns how many."""
    places = [
        (parent, name, child)
        for parent in list(module.modules())
        for name, child in list(parent.named_children())
        if isinstance(child, nn.Linear)
    ]

    def pack(child: nn.Linear) -> nn.Module:
        packed = kind(child.weight, child.bias)
        packed.source_digests = source_digests(child.weight, child.bias)
        return packed

    # on every core: the layouts' time is mostly the kernel faulting their fresh pages in, which
    # runs in parallel (the default model's start: 1.3-2.4 -> 1.0-1.5 s on a 2-vCPU Zen 4)
    workers = min(len(places), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    if workers > 1:
        with ThreadPoolExecutor(workers) as pool:
            layers = list(pool.map(pack, [child for _, _, child in places]))
    else:
        layers = [pack(child) for _, _, child in places]
    for (parent, name, _), packed in zip(places, layers):
        setattr(parent, name, packed)
    return len(places)
