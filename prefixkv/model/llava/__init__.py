"""LLaVA 1.5 style vision-language models (docs/multimodal.md): the checkpoint's vision config
(config.py), the CLIP vision tower and projector (vision.py), CLIP image preprocessing
(processor.py), and loading an HF folder into prefixkv's decoder plus these (loader.py). What a
prompt's images become and how the runner splices their embeddings in is prefixkv/multimodal/'s."""

from .config import MULTIMODAL_ARCHITECTURES, LlavaConfig, VisionConfig
from .loader import MultiModalModel, load_llava
from .processor import ImageProcessor
from .vision import VisionEncoder

__all__ = [
    "MULTIMODAL_ARCHITECTURES",
    "ImageProcessor",
    "LlavaConfig",
    "MultiModalModel",
    "VisionConfig",
    "VisionEncoder",
    "load_llava",
]
