"""Pinned prefixes named the way clients name them - prompt token ids, a tenant's cache salt, an
adapter - turned into the cache's pins (prefixkv/cache/pins.py)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, cast

from ..cache import KVCacheManager
from ..lora.request import LoRARequest
from ..request import Request
from .input_processor import InputProcessor


class PrefixPins:
    """`inputs` tokenizes a prefix as a prompt is tokenized; `resolve_lora` gives an adapter the
    identity its blocks carry (the engine's LoRA manager); `on_change` republishes the engine's
    stats after a pin or unpin."""

    def __init__(
        self,
        manager: KVCacheManager,
        inputs: InputProcessor,
        resolve_lora: Callable[[LoRARequest], tuple[LoRARequest, int]],
        on_change: Callable[[], None],
    ) -> None:
        self._manager = manager
        self._inputs = inputs
        self._resolve_lora = resolve_lora
        self._on_change = on_change
        self._ids = itertools.count()

    def token_ids(self, prefix: str | list[int] | list[dict[str, Any]], chat_template: str | None = None) -> list[int]:
        """A prefix given as text (tokenized as a prompt is), token ids, or chat messages (rendered
        without a generation prompt, as a chat request's system prompt is) - as token ids."""
        if isinstance(prefix, str):
            return self._inputs.tokenize(prefix)
        if prefix and all(isinstance(m, dict) for m in prefix):
            tokenizer = self._inputs.tokenizer
            text = tokenizer.apply_chat_template(
                cast("list[dict[str, Any]]", prefix),
                add_generation_prompt=False,
                tokenize=False,
                chat_template=chat_template,
            )
            return tokenizer.encode(cast(str, text), add_special_tokens=False)
        if prefix and all(isinstance(t, int) and not isinstance(t, bool) for t in prefix):
            return cast("list[int]", list(prefix))
        raise ValueError("pin_prefix takes a text, a list of token ids or a list of chat messages")

    def _request(self, prompt_token_ids: list[int], cache_salt: str | None, lora: LoRARequest | None) -> Request:
        if not prompt_token_ids:
            raise ValueError("a prefix to pin has at least one token")
        resolved = self._resolve_lora(lora)[0] if lora is not None else None
        return Request(f"pin-{next(self._ids)}", prompt_token_ids, lora_request=resolved, cache_salt=cache_salt)

    def pin(self, prompt_token_ids: list[int], cache_salt: str | None = None, lora: LoRARequest | None = None) -> int:
        """Pin the cached whole blocks of this prefix (compute it first: `LLM.pin_prefix` does);
        returns the tokens pinned. PinError (a ValueError) when nothing of it is cached or the pin
        would pass max_pinned_fraction."""
        pin = self._manager.pin(self._request(prompt_token_ids, cache_salt, lora))
        self._on_change()
        return pin.num_tokens

    def unpin(self, prompt_token_ids: list[int], cache_salt: str | None = None, lora: LoRARequest | None = None) -> int:
        """Release the pin of this prefix (same tenant, same adapter); returns the tokens it held,
        0 when it was not pinned."""
        pin = self._manager.unpin(self._request(prompt_token_ids, cache_salt, lora))
        self._on_change()
        return 0 if pin is None else pin.num_tokens
