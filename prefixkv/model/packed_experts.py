"""A layer's routed experts with every expert's two products laid out for the CPU's kernels, as the
dense layers' are (LlamaModel.pack_for_cpu chooses the layout, by timing, for the model's products:
oneDNN-packed, two layouts with the native small-batch kernel for a decode step's rows, or the
native layout alone), where one expert's products time faster in it than F.linear on slices of the
3-D parameters (`time_one_expert`). At gpt-oss-20b's width (2 layers, float32, AMD EPYC Zen 2) a
478-token prefill went from 3.2 to 2.1 s and a decode step of 8 from 400 to 322 ms
(bench/step_times.py, docs/benchmarks.md).

One copy replaces the parameters (their memory is given back); `source_digests` stands for them
where the model's weights are identified, under the experts module's own names."""

from __future__ import annotations

import logging
import time
from typing import Any, cast

import torch
from torch import nn

from . import moe
from .layers import LinearKind, tensor_digest
from .moe import ExpertProducts, route

logger = logging.getLogger(__name__)


class PackedExperts(nn.Module):
    """forward(x [T, H], top_index / top_weight [T, k]) -> [T, H], as the experts it was made from."""

    source_digests: dict[str, str]

    def __init__(self, products: ExpertProducts, kind: LinearKind, digests: dict[str, str]) -> None:
        super().__init__()
        gate_up, down, gate_up_bias, down_bias, activation = products
        E = gate_up.shape[0]
        self.num_experts = E
        self.gate_up = nn.ModuleList(
            kind(gate_up[e], None if gate_up_bias is None else gate_up_bias[e]) for e in range(E)
        )
        self.down = nn.ModuleList(kind(down[e], None if down_bias is None else down_bias[e]) for e in range(E))
        self.activation = activation
        self.source_digests = digests

    def forward(self, x: torch.Tensor, top_index: torch.Tensor, top_weight: torch.Tensor) -> torch.Tensor:
        return route(x, top_index, top_weight, self.num_experts, self._one)

    def _one(self, rows: torch.Tensor, e: int) -> torch.Tensor:
        return self.down[e](self.activation(self.gate_up[e](rows)))


# an expert's rows in a decode step, and in a prefill's chunk (a few per expert: top-k of E)
TIMED_ROWS = (1, 16)


def time_one_expert(experts: nn.Module, kind: LinearKind, reps: int = 5) -> tuple[float, float]:
    """(plain, packed): the best of `reps`, in ms, of expert 0's two products at each of
    TIMED_ROWS summed, on its plain parameters (F.linear) and in `kind`'s layout. The layout is
    kept only where it runs faster here: on a tiny model's experts (hidden 256) its per-call cost
    outweighed the gain (bench/hybrid.py, Zen 2: a cached question 14.5-17.8 ms plain against
    16.3-24.0 packed), at gpt-oss-20b's width it won at every row count."""
    owner = cast(Any, experts)
    candidate = PackedExperts(owner.expert_products(count=1), kind, {})
    hidden = next(experts.parameters()).shape[-1]
    dtype = next(experts.parameters()).dtype
    runs = (owner._one, candidate._one)
    totals = [0.0, 0.0]
    with torch.inference_mode():
        for rows in TIMED_ROWS:
            x = torch.randn(rows, hidden).to(dtype)
            for run in runs:  # both warm (a kernel's first use, the thread pool's start) before either is timed
                run(x, 0)
                run(x, 0)
            times: list[list[float]] = [[], []]
            for _ in range(reps):  # alternated, so that the machine's drift falls on both
                for which, run in enumerate(runs):
                    start = time.perf_counter()
                    run(x, 0)
                    times[which].append(time.perf_counter() - start)
            for which in (0, 1):
                totals[which] += min(times[which]) * 1e3  # the best: a neighbour's burst slows one rep
    return totals[0], totals[1]


def parameter_digests(module: nn.Module) -> dict[str, str]:
    """The digests of `module`'s own parameters, by name (what PackedExperts stands for)."""
    with torch.no_grad():
        return {name: tensor_digest(p) for name, p in module.named_parameters(recurse=False)}


def expert_bytes(module: nn.Module) -> int:
    """The bytes of every experts module's parameters below `module` (what packing them lays out)."""
    return sum(
        p.numel() * p.element_size()
        for m in module.modules()
        if hasattr(m, "expert_products")
        for p in m.parameters(recurse=False)
    )


def pack_experts(module: nn.Module, kind: LinearKind) -> int:
    """Replace every experts module below `module` (one with an `expert_products()` method:
    moe.Experts, gpt_oss.GptOssExperts) by its PackedExperts in `kind`'s layout; returns how many:
    0 where the timing kept them plain, or where the device's routing runs on CPU tensors
    (moe.GROUPED_ON_CPU: its grouped products read the 3-D parameters)."""
    if moe.GROUPED_ON_CPU:
        return 0
    places = [
        (parent, name, child)
        for parent in list(module.modules())
        for name, child in list(parent.named_children())
        if hasattr(child, "expert_products")
    ]
    if not places:
        return 0
    plain_ms, packed_ms = time_one_expert(places[0][2], kind)
    if packed_ms >= plain_ms:
        logger.info(
            "routed experts kept as plain parameters: one expert's products at 1 and %d rows took %.2f ms in "
            "%s's layout against %.2f ms with F.linear",
            TIMED_ROWS[-1], packed_ms, kind.__name__, plain_ms,
        )  # fmt: skip
        return 0
    for parent, name, child in places:
        setattr(parent, name, PackedExperts(cast(Any, child).expert_products(), kind, parameter_digests(child)))
    return len(places)
