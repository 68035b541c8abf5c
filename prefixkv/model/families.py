"""Which decoder class builds a config: the Llama decoder, or a family with its own block."""

from __future__ import annotations

import torch

from .config import ModelConfig
from .falcon_h1 import FalconH1Model
from .gemma import GemmaModel
from .hybrid import HybridModel
from .llama import LlamaModel
from .mamba2 import Mamba2Model
from .qwen3_next import Qwen3NextModel


def model_class(config: ModelConfig) -> type[LlamaModel]:
    if config.architecture == "BambaForCausalLM":
        return HybridModel
    if config.architecture == "FalconH1ForCausalLM":
        return FalconH1Model
    if config.architecture == "Qwen3NextForCausalLM":
        return Qwen3NextModel
    if config.is_recurrent:
        return Mamba2Model
    return GemmaModel if config.is_gemma else LlamaModel


def build_model(
    config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", seed: int = 0
) -> LlamaModel:
    """A randomly initialised model of the config's family (for tests)."""
    model = model_class(config)(config, dtype=dtype, device=device)
    model.init_random_weights(seed)
    return model.eval()
