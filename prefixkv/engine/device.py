"""Where the engine runs: its device and dtype, from the configuration and a model handed in."""

from __future__ import annotations

import torch

from ..engine_args import DTYPES, EngineArgs
from ..model import LoadedModel


def resolve_device_dtype(config: EngineArgs, loaded: LoadedModel | None = None) -> tuple[torch.device, torch.dtype]:
    """The engine's device and dtype: as configured; where left to the engine, those of a model
    handed in already loaded (its weights decide where the KV cache must live), else CUDA when
    present in bfloat16, the CPU in float32 (as vLLM). A configured one that contradicts the
    loaded model's is refused: the engine would put its KV cache where the model cannot read it."""
    if config.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {config.dtype!r}; choose {', '.join(DTYPES)}")
    weights = loaded.model.embed_tokens.weight if loaded is not None else None
    if config.device is not None:
        device = torch.device(config.device)
    elif weights is not None:
        device = weights.device
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and weights is None:
        if not torch.cuda.is_available():
            raise ValueError(f"device={config.device!r} but CUDA is not available here (torch {torch.__version__})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device={config.device!r} but this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    name = DTYPES[config.dtype]
    if weights is not None:
        if device.type != weights.device.type or (device.index is not None and device != weights.device):
            raise ValueError(f"device={config.device!r} but the model handed to the engine is on {weights.device}")
        if name is not None and getattr(torch, name) != weights.dtype:
            raise ValueError(f"dtype={config.dtype!r} but the model handed to the engine is {weights.dtype}")
        return device, weights.dtype
    return device, getattr(torch, name or ("float32" if device.type == "cpu" else "bfloat16"))
