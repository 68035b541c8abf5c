"""What the cache needs of a request - and nothing more.

The cache package imports nothing else of prefixkv; `prefixkv.request.Request` satisfies these
protocols, and so can any object a benchmark or another engine brings.
"""
from __future__ import annotations

from typing import Protocol, Sequence


class LoRAKey(Protocol):
    lora_name: str
    lora_path: str


class MultiModalKey(Protocol):
    identifier: str  # content hash of the item, computed by whoever preprocesses it
    offset: int  # index of the item's first placeholder token in the prompt
    length: int  # number of placeholder tokens


class CacheRequest(Protocol):
    request_id: str
    num_computed_tokens: int
    lora_request: LoRAKey | None
    mm_items: Sequence[MultiModalKey]
    cache_salt: str | None

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def num_tokens(self) -> int: ...

    # Read only when a request is freed, and only by eviction policies that learn from finished
    # requests (those overriding on_request_free): the default path never touches them.
    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_output_tokens(self) -> int: ...
