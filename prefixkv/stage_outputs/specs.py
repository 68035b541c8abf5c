"""What the stage-output cache declares in the engine's one memory budget, and which of a model's
outputs it caches."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..memory.block_tensors import BlockTensorSpec
from ..model import ModelConfig

STAGE_PREFIX = "stage."
HIDDEN_STATES = "hidden_states"


def spec_name(name: str, dtype: torch.dtype) -> str:
    """One per-block tensor per output name and dtype: "stage.hidden_states:float32"."""
    return f"{STAGE_PREFIX}{name}:{str(dtype).removeprefix('torch.')}"


def stage_output_specs(config: ModelConfig, block_size: int, dtype: torch.dtype) -> list[BlockTensorSpec]:
    """The final hidden states, `(num_blocks, block_size, hidden_size)` on the CPU, counted in the
    budget at once and allocated on first write. Other per-token outputs must be declared here too
    (a model that returns them adds its spec), so the budget always counts what is cached."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return [BlockTensorSpec(spec_name(HIDDEN_STATES, dtype), (block_size, config.hidden_size), dtype, 0, "cpu", True)]


def per_token_outputs(output: torch.Tensor | Mapping[str, torch.Tensor], num_tokens: int) -> dict[str, torch.Tensor]:
    """The outputs of one forward pass that the cache keeps: a tensor is the final hidden states;
    of a mapping, every tensor whose first dimension is the step's token count (vLLM-Omni's rule:
    such a tensor can be addressed with the KV cache's slot mapping)."""
    if isinstance(output, torch.Tensor):
        return {HIDDEN_STATES: output}
    return {
        name: t
        for name, t in output.items()
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == num_tokens
    }
