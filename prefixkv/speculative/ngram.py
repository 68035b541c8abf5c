"""The n-gram drafter (vLLM's "ngram" method, prompt lookup decoding): a sequence's last n tokens
are looked up among its earlier tokens - the prompt and the output so far - and the tokens that
followed the latest earlier occurrence are proposed, the longest n in [min, max] first.

Each request keeps an index per n: n-gram -> the position after its latest occurrence, extended
with the tokens it gained since the last call, so a proposal costs a few dict operations whatever
the context's length (the whole prompt is indexed at a request's first proposal)."""

from __future__ import annotations

from collections.abc import Sequence


class _Index:
    __slots__ = ("after", "upto")

    def __init__(self, sizes: range) -> None:
        # per n: n-gram -> the position of the token that followed its latest occurrence
        self.after: list[dict[tuple[int, ...], int]] = [{} for _ in sizes]
        self.upto = 0  # positions < upto have been entered as "the token after"

    def extend(self, tokens: Sequence[int], sizes: range) -> None:
        """Enter every n-gram followed by a known token: those ending before position len - 1
        (the sequence's own last n-gram, followed by nothing yet, is what is looked up)."""
        end = len(tokens) - 1
        for pos in range(max(self.upto, sizes.start), end + 1):
            for table, n in zip(self.after, sizes):
                if pos >= n:
                    table[tuple(tokens[pos - n : pos])] = pos
        self.upto = max(self.upto, end + 1)


class NgramDrafter:
    """Proposes up to `num_speculative_tokens` draft tokens per request and step (scheduler.py)."""

    def __init__(self, k: int, lookup_min: int, lookup_max: int, off_above: int | None, max_model_len: int) -> None:
        self.k = k
        self.sizes = range(lookup_min, lookup_max + 1)
        self.off_above = off_above
        self.max_model_len = max_model_len
        self._indexes: dict[str, _Index] = {}

    def propose(self, request_id: str, tokens: Sequence[int], room: int) -> list[int]:
        """Draft tokens to follow `tokens` (the request's every token), at most `room` of them."""
        room = min(room, self.k)
        if room <= 0 or len(tokens) <= self.sizes.start:
            return []
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = _Index(self.sizes)
        index.extend(tokens, self.sizes)
        total = len(tokens)
        for table, n in zip(reversed(index.after), reversed(self.sizes)):
            if n >= total:
                continue
            at = table.get(tuple(tokens[total - n :]))
            if at is not None:
                return list(tokens[at : at + room])
        return []

    def forget(self, request_id: str) -> None:
        """The request ended: its index goes."""
        self._indexes.pop(request_id, None)
