"""Multimodal inputs for the vision-language models of prefixkv/model/llava/ (docs/multimodal.md).
Prompt side: images -> placeholder tokens and items (inputs.py; item.py's `MultiModalItem`, named
by hashing.py's identity), images named in chat messages (chat.py, media.py). Runner side: which
rows of an item a chunk needs (encoder_input.py), the encoder output cache (encoder_cache.py)
and splicing the embeddings into the step's input (embedding.py)."""

from .embedding import MultiModalEmbedder
from .encoder_cache import EncoderCache, EncoderCacheStats
from .encoder_input import EncoderInput
from .hashing import MM_HASH_MODES, item_identity
from .inputs import MultiModalInputProcessor, load_image
from .item import MultiModalItem

__all__ = [
    "MM_HASH_MODES",
    "EncoderCache",
    "EncoderCacheStats",
    "EncoderInput",
    "MultiModalEmbedder",
    "MultiModalInputProcessor",
    "MultiModalItem",
    "item_identity",
    "load_image",
]
