"""Counters of speculative decoding, as vLLM's metrics name them (vllm:spec_decode_*)."""

from __future__ import annotations


class SpecDecodeStats:
    """Drafts verified (one per request and step that had any), draft tokens, those kept, and
    those kept per position (position 0: the first draft)."""

    __slots__ = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_position")

    def __init__(self, k: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * k

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per = self.accepted_per_position
        for pos in range(num_accepted):
            per[pos] += 1
