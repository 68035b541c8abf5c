"""Model layer: configs, tokenizer, weight loading and paged-attention decoder models."""

from .attention import AttentionMetadata, kv_cache_block_shape, paged_attention
from .config import ModelConfig
from .configs.registry import SUPPORTED_ARCHITECTURES
from .families import build_model, model_class
from .llama import LlamaModel
from .loader import LoadedModel, default_model_path, load_model
from .tokenizer import Tokenizer

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "AttentionMetadata",
    "LlamaModel",
    "LoadedModel",
    "ModelConfig",
    "Tokenizer",
    "build_model",
    "default_model_path",
    "kv_cache_block_shape",
    "load_model",
    "model_class",
    "paged_attention",
]
