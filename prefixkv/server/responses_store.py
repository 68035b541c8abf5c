"""Stored responses, for `previous_response_id` and GET/DELETE /v1/responses/{id}: in memory,
the most recently used N kept (least recently used evicted first), nothing on disk.

N is `$PREFIXKV_RESPONSES_MAX_STORED` (default 1000; 0 keeps none). Each entry holds the response
body and the conversation it ends (the messages of every turn, its own output last), so the next
turn renders the whole conversation again and its prompt starts with the previous prompt's
tokens: the prefix cache reuses them."""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_STORED = 1000


def max_stored_from_env() -> int:
    raw = os.environ.get("PREFIXKV_RESPONSES_MAX_STORED", "").strip()
    if not raw:
        return DEFAULT_MAX_STORED
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"PREFIXKV_RESPONSES_MAX_STORED must be an integer >= 0, got {raw!r}") from None
    if n < 0:
        raise ValueError(f"PREFIXKV_RESPONSES_MAX_STORED must be an integer >= 0, got {raw!r}")
    return n


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the response object as it was answered
    conversation: list[dict[str, Any]]  # chat messages, without the request's instructions
    cache_salt: str | None  # a chained request must carry the same salt (another tenant's is unknown)


class ResponseStore:
    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.max_entries == 0:
            return
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None
