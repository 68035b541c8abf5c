"""Storage for a module built on the meta device (shapes only, no initialisation), before its
weights are loaded.

`nn.Module.to_empty` does this through `torch.empty_like`, whose meta-tensor path runs in
torch._refs; its first call in a process imports sympy (via torch.fx's symbolic shapes): 0.6-0.9
CPU-s of every process that builds a model on an AMD Zen 3, an engine's start and each test
server's alike. Here each tensor is made with `torch.empty` directly, floating-point ones already
in the model's dtype (no second copy from `.to(dtype)`)."""

from __future__ import annotations

import torch
from torch import nn


def materialize(module: nn.Module, device: torch.device | str, dtype: torch.dtype) -> None:
    """Give every meta parameter and buffer of `module` uninitialised storage on `device`
    (floating-point ones in `dtype`); a tensor shared between submodules stays shared."""
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (the meta tensor, kept alive; its storage)

    def empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)

    for sub in module.modules():
        for name, p in sub._parameters.items():
            if p is not None and p.is_meta:
                if id(p) not in made:
                    made[id(p)] = (p, nn.Parameter(empty(p), requires_grad=p.requires_grad))
                sub._parameters[name] = made[id(p)][1]  # type: ignore[assignment]
        for name, b in sub._buffers.items():
            if b is not None and b.is_meta:
                if id(b) not in made:
                    made[id(b)] = (b, empty(b))
                sub._buffers[name] = made[id(b)][1]
