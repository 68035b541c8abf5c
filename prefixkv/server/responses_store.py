"""Stored responses, for `previous_response_id` and GET/DELETE /v1/responses/{id}: in memory,
the most recently used kept (least recently used evicted first), nothing on disk.

Two bounds, from the environment: `$PREFIXKV_RESPONSES_MAX_STORED` responses (default 1000; 0
keeps none) and `$PREFIXKV_RESPONSES_MAX_STORED_BYTES` of text (default 256 MiB; counted as the
characters of every string an entry holds - image data URLs included - so a client cannot grow the
server's memory without bound). Each entry holds the response body and the conversation it ends
(the messages of every turn, its own output last), so the next turn renders the whole conversation
again and its prompt starts with the previous prompt's tokens: the prefix cache reuses them."""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_STORED = 1000
DEFAULT_MAX_STORED_BYTES = 256 << 20


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {raw!r}")
    return n


def max_stored_from_env() -> int:
    return _env_int("PREFIXKV_RESPONSES_MAX_STORED", DEFAULT_MAX_STORED)


def max_stored_bytes_from_env() -> int:
    return _env_int("PREFIXKV_RESPONSES_MAX_STORED_BYTES", DEFAULT_MAX_STORED_BYTES)


def text_size(obj: Any) -> int:
    """Characters of every string in a JSON-like value (plus a little for each container)."""
    if isinstance(obj, str):
        return len(obj)
    if isinstance(obj, dict):
        return 8 + sum(len(k) + text_size(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return 8 + sum(text_size(v) for v in obj)
    return 8


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the response object as it was answered
    conversation: list[dict[str, Any]]  # chat messages, without the request's instructions
    cache_salt: str | None  # a chained request must carry the same salt (another tenant's is unknown)
    size: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.size = text_size(self.body) + text_size(self.conversation)


class ResponseStore:
    def __init__(self, max_entries: int, max_bytes: int = DEFAULT_MAX_STORED_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.size = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> bool:
        """Keep the entry (evicting the least recently used past a bound); False when it alone
        is over the byte bound, or nothing is kept."""
        if self.max_entries == 0 or entry.size > self.max_bytes:
            return False
        self.delete(response_id)
        self._entries[response_id] = entry
        self.size += entry.size
        while len(self._entries) > self.max_entries or self.size > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.size -= old.size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.size -= entry.size
        return True
