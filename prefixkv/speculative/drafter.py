"""What the scheduler asks of a drafter (one per method: methods.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Drafter(Protocol):
    k: int  # most drafts a request gets a step
    off_above: int | None  # no drafts while more requests than this are running (None: always)
    max_model_len: int

    def propose(self, request_id: str, tokens: Sequence[int], room: int) -> list[int]:
        """Up to `room` draft tokens to follow `tokens`, the request's every token."""
        ...

    def forget(self, request_id: str) -> None:
        """The request ended."""
        ...
