"""Model layer: configs, tokenizer, weight loading and paged-attention decoder models."""

from .attention import AttentionMetadata, allocate_kv_cache, kv_cache_bytes_per_block, paged_attention
from .config import SUPPORTED_ARCHITECTURES, ModelConfig
from .llama import LlamaModel, build_model
from .loader import LoadedModel, default_model_path, load_model
from .tokenizer import Tokenizer

__all__ = [
    "AttentionMetadata",
    "LlamaModel",
    "LoadedModel",
    "ModelConfig",
    "SUPPORTED_ARCHITECTURES",
    "Tokenizer",
    "allocate_kv_cache",
    "build_model",
    "default_model_path",
    "kv_cache_bytes_per_block",
    "load_model",
    "paged_attention",
]
