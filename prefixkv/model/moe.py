"""Mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5, MiniMax-M2, ...): a router picks
each token's top-k experts, each a gated MLP of its own, and the token's output is their weighted
sum (plus, for Qwen2-MoE and GLM-4.5, a shared expert: scaled by a sigmoid gate, or not).

Routed on the CPU without a Python loop over tokens: the (token, expert) pairs are sorted by
expert, each active expert multiplies its contiguous slice of gathered rows in two matmuls, and
one index_add puts the weighted rows back. The loop is over experts, at most num_experts short
iterations a layer, after one read of the counts. A device does the same without that read - a
host read a layer would make the host wait for the device, and a CUDA graph cannot hold one: the
counts stay on the device as offsets of torch._grouped_mm, one grouped product for every expert's
rows (`Experts.grouped`, where `grouped_works` found it runs for the weights' dtype and shapes on
that device). Routing follows transformers' modeling_qwen3_moe / modeling_mixtral exactly:
router logits by F.linear (the router is kept out of the packed kernel layouts so its top-k choice
sees the same numbers), softmax in float32, top-k, optional renormalisation, then the weights in
the model's dtype.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import GatedMLP


class Projection(nn.Module):
    """x @ weight.T (+ bias) on plain parameters: a small matrix (a router) that `pack_linears`
    leaves in F.linear's hands, as transformers computes it."""

    def __init__(self, out_features: int, in_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


# run the device's routing (`Experts.grouped`) on CPU tensors too: how the CPU tests check it
GROUPED_ON_CPU = False


class Experts(nn.Module):
    """The routed experts' weights as 3-D parameters (transformers 5's layout): `gate_up_proj`
    [E, 2I, H] (gate rows first) and `down_proj` [E, H, I]; the gate's `activation` SiLU, or
    GELU's tanh approximation ("gelu_pytorch_tanh": Gemma 4)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported expert activation {activation!r}")
        self.num_experts = num_experts
        self.intermediate = intermediate
        self.gelu = activation == "gelu_pytorch_tanh"
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self._grouped_works: dict[tuple[torch.device, torch.dtype], bool] = {}

    def forward(self, x: torch.Tensor, top_index: torch.Tensor, top_weight: torch.Tensor) -> torch.Tensor:
        """x [T, H], top_index / top_weight [T, k] -> sum over each token's k experts of
        weight * expert(x) [T, H]."""
        if (x.device.type != "cpu" or GROUPED_ON_CPU) and self.grouped_works():
            return self.grouped(x, top_index, top_weight)
        return route(x, top_index, top_weight, self.num_experts, self._one)

    def grouped(self, x: torch.Tensor, top_index: torch.Tensor, top_weight: torch.Tensor) -> torch.Tensor:
        """`forward` without a host read: the pairs sorted by expert as there, each expert's count
        summed on the device into the offsets of one grouped product per matrix. Shapes depend on
        T alone (a CUDA graph captures it). Each token's k rows are put back in place and summed in
        their top-k order, not added with index_add_ (a GPU's atomic adds would sum them in an
        order that changes from run to run)."""
        T, k = top_index.shape
        flat = top_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        tokens = order // k
        rows = x.index_select(0, tokens)
        weights = top_weight.reshape(-1, 1).index_select(0, order)
        gate_up = torch._grouped_mm(rows, self.gate_up_proj.transpose(1, 2), offs=offsets)
        out = torch._grouped_mm(self.activation(gate_up), self.down_proj.transpose(1, 2), offs=offsets)
        pairs = torch.empty_like(out).index_copy_(0, order, out.mul_(weights))  # back in (token, k) order
        return pairs.view(T, k, -1).sum(dim=1)

    def grouped_works(self) -> bool:
        """Whether torch._grouped_mm takes these weights (their dtype, shapes and device): tried
        once on two rows, against the per-expert products (this torch may lack it, or a device
        may take it for bfloat16 only)."""
        key = (self.gate_up_proj.device, self.gate_up_proj.dtype)
        works = self._grouped_works.get(key)
        if works is None:
            works = False
            if hasattr(torch, "_grouped_mm") and self.gate_up_proj.numel():
                try:
                    with torch.inference_mode():
                        x = torch.randn(2, self.gate_up_proj.shape[2], dtype=key[1], device=key[0])
                        index = torch.tensor([[0], [self.num_experts - 1]], device=key[0])
                        weight = torch.ones(2, 1, dtype=key[1], device=key[0])
                        got = self.grouped(x, index, weight).float()
                        want = torch.stack([self._one(x[0], 0), self._one(x[1], self.num_experts - 1)]).float()
                        works = bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()) + 1e-6))
                except (RuntimeError, NotImplementedError, TypeError):
                    works = False
            self._grouped_works[key] = works
        return works

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[rows, 2I] -> act(gate) * up [rows, I]."""
        if self.gelu:
            return gelu_and_mul(gate_up, self.intermediate)
        return silu_and_mul(gate_up, self.intermediate)

    def _one(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """Expert e on rows x."""
        return F.linear(self.activation(F.linear(x, self.gate_up_proj[e])), self.down_proj[e])

    def expert_products(self, count: int | None = None) -> ExpertProducts:
        """What each expert computes (the first `count` alone), for a layout of its own
        (model/packed_experts.py)."""
        act = gelu_and_mul if self.gelu else silu_and_mul
        activation = functools.partial(act, intermediate=self.intermediate)
        return ExpertProducts(self.gate_up_proj[:count], self.down_proj[:count], None, None, activation)


class ExpertProducts(NamedTuple):
    """A layer's experts as two products and an activation between them: gate_up [E, 2I, H],
    down [E, H, I], their biases ([E, 2I], [E, H]) or None, and the activation, [rows, 2I] ->
    [rows, I], which holds no weight."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    activation: Callable[[torch.Tensor], torch.Tensor]


def silu_and_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """[rows, 2I] (gate columns first) -> silu(gate) * up [rows, I]. torch's SiLU, not the native
    kernel: at an expert's few rows of a decode step its start-up cost more than it saved
    (bench/moe.py: 1 row, 4.4 -> 3.4 ms a layer)."""
    g, u = gate_up.split(intermediate, dim=-1)
    return F.silu(g) * u


def gelu_and_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """[rows, 2I] (gate columns first) -> gelu_tanh(gate) * up [rows, I] (GeGLU)."""
    g, u = gate_up.split(intermediate, dim=-1)
    return F.gelu(g, approximate="tanh") * u


def route(
    x: torch.Tensor,
    top_index: torch.Tensor,
    top_weight: torch.Tensor,
    num_experts: int,
    expert: Callable[[torch.Tensor, int], torch.Tensor],
) -> torch.Tensor:
    """x [T, H], top_index / top_weight [T, k] -> sum over each token's k experts of
    weight * expert(rows, e) [T, H], without a loop over tokens: the (token, expert) pairs sorted
    by expert (stable: a token's experts keep transformers' summation order), each active expert
    fed its contiguous slice of gathered rows, one index_add putting the weighted rows back."""
    T, k = top_index.shape
    flat = top_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # one host read a layer
    tokens = order // k
    rows = x.index_select(0, tokens)
    weights = top_weight.reshape(-1, 1).index_select(0, order)
    out_rows = torch.empty_like(rows)
    start = 0
    for e, n in enumerate(counts):
        if not n:
            continue
        end = start + n
        torch.mul(expert(rows[start:end], e), weights[start:end], out=out_rows[start:end])
        start = end
    return torch.zeros_like(x).index_add_(0, tokens, out_rows)


class SparseMoeBlock(nn.Module):
    """The MLP of a mixture-of-experts layer: forward(x [T, H]) -> [T, H]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.sigmoid = config.router_scoring == "sigmoid"
        self.logits_float32 = config.router_logits_float32
        self.scores_float32 = config.router_scores_float32
        self.num_groups = config.router_num_groups
        self.topk_groups = config.router_topk_groups
        self.norm_epsilon = config.router_norm_epsilon
        self.scaling = config.routed_scaling_factor
        self.gate = Projection(config.num_experts, config.hidden_size)  # the router
        # added to the scores for choosing the top k only (float32, as transformers keeps it)
        self.expert_bias: nn.Parameter | None = None
        if config.router_selection_bias:
            self.expert_bias = nn.Parameter(torch.zeros(config.num_experts), requires_grad=False)
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: Projection | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size)
            if config.shared_expert_gated:
                self.shared_expert_gate = Projection(1, config.hidden_size)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts [T, k] and their weights [T, k] in x's dtype."""
        if self.logits_float32:  # (the model keeps this router's weight in float32)
            logits = F.linear(x.float(), self.gate.weight.float())
        else:
            logits = self.gate(x)
        if self.sigmoid:
            scores = (logits.float() if self.scores_float32 else logits).sigmoid()
        else:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        if self.expert_bias is not None or self.num_groups > 1:
            choice = scores if self.expert_bias is None else scores + self.expert_bias
            if self.num_groups > 1:
                choice = self._within_best_groups(choice)
            top_index = torch.topk(choice, self.top_k, dim=-1).indices
            top_weight = scores.gather(1, top_index)
        else:
            top_weight, top_index = torch.topk(scores, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_weight = top_weight / (top_weight.sum(dim=-1, keepdim=True) + self.norm_epsilon)
        if self.scaling != 1.0:
            top_weight = top_weight * self.scaling
        return top_index, top_weight.to(x.dtype)

    def _within_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """The choice scores [T, E] with every expert outside each token's `topk_groups` best
        groups at -inf: a group's worth is the sum of its two best scores (DeepSeek-V3's rule)."""
        T = choice.shape[0]
        grouped = choice.view(T, self.num_groups, -1)
        worth = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best = worth.topk(self.topk_groups, dim=-1).indices
        keep = torch.zeros_like(worth, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(T, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_index, top_weight = self.route(x)
        y = self.experts(x, top_index, top_weight)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            y = y + (shared if self.shared_expert_gate is None else torch.sigmoid(self.shared_expert_gate(x)) * shared)
        return y


def build_mlp(config: ModelConfig, layer_index: int) -> nn.Module:
    """Decoder layer `layer_index`'s MLP: routed experts where the config makes it sparse, else
    the dense gated MLP."""
    if config.is_moe_layer(layer_index):
        return SparseMoeBlock(config)
    return GatedMLP(config.hidden_size, config.intermediate_size)


# ------------------------------------------------------------------ checkpoint names
# One expert's matrix: HF (Qwen) gate_proj / up_proj / down_proj, Mixtral w1 / w3 / w2.
_ONE_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_KIND = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# All experts stacked [E, ...]: transformers 5's fused gate_up_proj / down_proj, and GGUF's
# ffn_{gate,up,down}_exps (loader.py names those mlp.experts.{gate,up,down}_proj).
_STACKED = re.compile(r"^mlp\.experts\.(gate_up_proj|gate_proj|up_proj|down_proj)$")

Piece = tuple[str, tuple[int, ...] | None, torch.Tensor]


def expert_pieces(rest: str, t: torch.Tensor, config: ModelConfig, layer: int) -> list[Piece] | None:
    """Where a checkpoint tensor of a mixture-of-experts layer goes: (parameter name below the
    layer, index, tensor) triples - index (e, start, end): rows start:end of expert e; (e,): all of
    expert e; (start, end): rows of a 2-D parameter. `rest` is the name below
    `model.layers.N.`, Mixtral's `block_sparse_moe.` already read as `mlp.`. None where the tensor
    is not an expert's, a router's or a shared expert's (the caller maps it as for a dense layer)."""
    if not rest.startswith("mlp.") or not config.is_moe_layer(layer):
        return None
    I = config.moe_intermediate_size
    E = config.num_experts
    halves = {"gate_proj": (0, I), "up_proj": (I, 2 * I)}
    m = _ONE_EXPERT.match(rest)
    if m:
        e, kind = int(m.group(1)), _KIND.get(m.group(2), m.group(2))
        if e >= E:
            raise ValueError(f"expert {e} of layer {layer}: the config has {E} experts")
        if kind == "down_proj":
            return [("mlp.experts.down_proj", (e,), t)]
        return [("mlp.experts.gate_up_proj", (e, *halves[kind]), t)]
    m = _STACKED.match(rest)
    if m:
        kind = m.group(1)
        if t.dim() != 3 or t.shape[0] != E:
            raise ValueError(f"layer {layer} {rest}: shape {tuple(t.shape)}, expected [{E}, ...] (one per expert)")
        if kind == "down_proj":
            return [("mlp.experts.down_proj", (e,), t[e]) for e in range(E)]
        if kind == "gate_up_proj":
            return [
                ("mlp.experts.gate_up_proj", (e, *halves[k]), h)
                for e in range(E)
                for k, h in zip(halves, t[e].split(I))
            ]
        return [("mlp.experts.gate_up_proj", (e, *halves[kind]), t[e]) for e in range(E)]
    S = config.shared_expert_intermediate_size
    if rest == "mlp.shared_expert.gate_proj.weight":
        return [("mlp.shared_expert.gate_up_proj.weight", (0, S), t)]
    if rest == "mlp.shared_expert.up_proj.weight":
        return [("mlp.shared_expert.gate_up_proj.weight", (S, 2 * S), t)]
    if rest == "mlp.shared_expert_gate.weight":
        return [(rest, None, t.reshape(1, -1))]  # GGUF keeps it 1-D
    return None


def expected_pieces(name: str, param: torch.Tensor) -> set[tuple[int, ...]] | None:
    """The indices `expert_pieces` fills of an experts parameter (None for any other)."""
    if name.endswith("experts.gate_up_proj"):
        E, I2 = param.shape[0], param.shape[1]
        return {(e, 0, I2 // 2) for e in range(E)} | {(e, I2 // 2, I2) for e in range(E)}
    if name.endswith("experts.down_proj"):
        return {(e,) for e in range(param.shape[0])}
    return None
