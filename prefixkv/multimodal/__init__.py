"""Multimodal inputs for the vision-language models of prefixkv/model/llava/ (docs/multimodal.md).
Prompt side: images -> placeholder tokens and items (inputs.py; item.py's `MultiModalItem`, named
by hashing.py's identity), images named in chat messages (chat.py, media.py). Runner side: which
rows of an item a chunk needs (encoder_input.py), the encoder output cache (encoder_cache.py)
and splicing the embeddings into the step's input (embedding.py)."""

from typing import TYPE_CHECKING

from ..lazy_exports import lazy_exports
from .item import MultiModalItem

if TYPE_CHECKING:
    from .embedding import MultiModalEmbedder
    from .encoder_cache import EncoderCache, EncoderCacheStats
    from .encoder_input import EncoderInput
    from .hashing import MM_HASH_MODES, item_identity
    from .inputs import MultiModalInputProcessor, load_image

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

# the item alone comes with the package (`prefixkv` exports it); the rest needs torch, numpy or PIL
__getattr__ = lazy_exports(
    __name__,
    {
        "MultiModalEmbedder": ".embedding",
        "EncoderCache": ".encoder_cache",
        "EncoderCacheStats": ".encoder_cache",
        "EncoderInput": ".encoder_input",
        "MM_HASH_MODES": ".hashing",
        "item_identity": ".hashing",
        "MultiModalInputProcessor": ".inputs",
        "load_image": ".inputs",
    },
)
