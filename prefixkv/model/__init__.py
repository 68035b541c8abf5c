"""Model layer: configs, tokenizer, weight loading and paged-attention decoder models.

The names below are imported on first use: a module that needs the tokenizer alone (the replicas'
router) imports `prefixkv.model.tokenizer` without the decoders' torch."""

from typing import TYPE_CHECKING

from ..lazy_exports import lazy_exports

if TYPE_CHECKING:
    from .attention import AttentionMetadata, kv_cache_block_shape, paged_attention
    from .config import ModelConfig
    from .configs.registry import SUPPORTED_ARCHITECTURES
    from .default_model import default_model_path
    from .families import build_model, model_class
    from .llama import LlamaModel
    from .loader import LoadedModel, load_model
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

__getattr__ = lazy_exports(
    __name__,
    {
        "AttentionMetadata": ".attention",
        "kv_cache_block_shape": ".attention",
        "paged_attention": ".attention",
        "ModelConfig": ".config",
        "SUPPORTED_ARCHITECTURES": ".configs.registry",
        "build_model": ".families",
        "model_class": ".families",
        "LlamaModel": ".llama",
        "LoadedModel": ".loader",
        "default_model_path": ".default_model",
        "load_model": ".loader",
        "Tokenizer": ".tokenizer",
    },
)
