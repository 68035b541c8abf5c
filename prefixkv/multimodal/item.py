"""`MultiModalItem`: an input's place in the prompt and its identity, as the request holds it and
the prefix cache keys blocks by it (`cache/protocol.py`'s `MultiModalKey`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class MultiModalItem:
    """A multimodal input occupying prompt positions [offset, offset + length) with placeholders;
    `identifier` is a hash of its content, so equal images share cache blocks. `data` is the
    encoder's input (preprocessed pixels); it takes no part in the item's identity."""

    identifier: str
    offset: int
    length: int
    data: Any = field(default=None, compare=False, hash=False, repr=False)
