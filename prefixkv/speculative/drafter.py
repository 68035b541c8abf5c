"""What the scheduler asks of a drafter, and the drafters by method: a new method is a module
beside ngram.py and one entry in DRAFTERS (its keys are the methods `SpeculativeConfig` accepts)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from .config import SpeculativeConfig
from .ngram import NgramDrafter


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


DRAFTERS: dict[str, Callable[[SpeculativeConfig, int], Drafter]] = {"ngram": NgramDrafter}


def build_drafter(config: SpeculativeConfig, max_model_len: int) -> Drafter:
    return DRAFTERS[config.method](config, max_model_len)
