"""`EncoderInput`: which rows of an item's encoder output one scheduled chunk needs, as the
scheduler hands it to the model runner's embedder (`embedding.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class EncoderInput:
    """A multimodal item's share of one chunk: rows `rows[0]:rows[1]` of its encoder output are the
    embeddings of the chunk's tokens `dest`, `dest + 1`, ... (an item may span several chunks, and a
    prefix hit may have covered its first rows already)."""

    identifier: str  # the item's identity (hashing.py)
    data: Any  # the encoder's input (preprocessed pixels)
    rows: tuple[int, int]
    dest: int
    # the request's cache_salt: with the identity, the encoder cache's key, so that a salted
    # request never reads an encoder output computed for another salt (encoder_cache.py)
    cache_salt: str | None = None

    @property
    def cache_key(self) -> tuple[str, str | None]:
        return (self.identifier, self.cache_salt)
