"""Vision-language models (LLaVA 1.5 style): image preprocessing, placeholder expansion and item
identities (prompt side), the vision encoder and its output cache (runner side). docs/multimodal.md."""

from .config import MULTIMODAL_ARCHITECTURES, LlavaConfig, VisionConfig
from .embedding import MultiModalEmbedder
from .encoder_cache import EncoderCache, EncoderCacheStats
from .hashing import MM_HASH_MODES, item_identity
from .inputs import MultiModalInputProcessor, load_image
from .loader import MultiModalModel
from .processor import ImageProcessor
from .vision import VisionEncoder

__all__ = [
    "MM_HASH_MODES",
    "MULTIMODAL_ARCHITECTURES",
    "EncoderCache",
    "EncoderCacheStats",
    "ImageProcessor",
    "LlavaConfig",
    "MultiModalEmbedder",
    "MultiModalInputProcessor",
    "MultiModalModel",
    "VisionConfig",
    "VisionEncoder",
    "item_identity",
    "load_image",
]
