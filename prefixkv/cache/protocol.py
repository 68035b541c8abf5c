"""What the cache needs of a request - and nothing more.

The cache package imports nothing else of prefixkv; `prefixkv.request.Request` satisfies these
protocols, and so can any object a benchmark or another engine brings. Every member is read-only
here (the cache never writes a request), so an attribute, a property or a frozen dataclass field
all satisfy it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class LoRAKey(Protocol):
    @property
    def lora_name(self) -> str: ...

    @property
    def lora_path(self) -> str: ...

    @property
    def weights_digest(self) -> str: ...  # names the adapter's weights: new weights, new identity


class MultiModalKey(Protocol):
    @property
    def identifier(self) -> str: ...  # content hash of the item, computed by whoever preprocesses it

    @property
    def offset(self) -> int: ...  # index of the item's first placeholder token in the prompt

    @property
    def length(self) -> int: ...  # number of placeholder tokens


class CacheRequest(Protocol):
    @property
    def request_id(self) -> str: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def lora_request(self) -> LoRAKey | None: ...

    @property
    def mm_items(self) -> Sequence[MultiModalKey]: ...

    @property
    def cache_salt(self) -> str | None: ...

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
