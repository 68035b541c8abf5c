"""Checks of the token-level constraint fields of SamplingParams (torch-free: SamplingParams
imports it). Token ids against the vocabulary are the engine's to check (`check_vocab`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's


class TokenConstraintFields(Protocol):
    """What the constraints read of a request's sampling parameters (SamplingParams satisfies
    it); declared here so that this package needs nothing of the layer that builds requests."""

    @property
    def logit_bias(self) -> Mapping[int, float] | None: ...

    @property
    def allowed_token_ids(self) -> Sequence[int] | None: ...

    @property
    def bad_words(self) -> Sequence[str] | None: ...


def normalize_logit_bias(value: Any) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys (strings): {"1234": -100}. ValueError when a key
    is not a token id or a bias is not a finite number in [-100, 100]."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"logit_bias must be a mapping of token ids to biases, got {type(value).__name__}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        token: Any = key
        if isinstance(key, str):
            token = int(key) if key.strip().lstrip("-").isdigit() else None
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
        lo, hi = LOGIT_BIAS_RANGE
        if (
            not isinstance(bias, (int, float))
            or isinstance(bias, bool)
            or not math.isfinite(bias)
            or not lo <= bias <= hi
        ):
            raise ValueError(f"logit_bias values must be numbers in [{lo:g}, {hi:g}], got {bias!r} for token {token}")
        out[token] = float(bias)
    return out


def check_token_fields(params: TokenConstraintFields) -> None:
    """The vocabulary-independent checks of the token-level fields (SamplingParams.verify)."""
    ids = params.allowed_token_ids
    if ids is not None:
        if not isinstance(ids, (list, tuple)) or not ids:
            raise ValueError("allowed_token_ids must be a non-empty list of token ids")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
            raise ValueError("allowed_token_ids must be non-negative integers")
    words = params.bad_words
    if words is not None:
        if not isinstance(words, (list, tuple)) or any(not isinstance(w, str) or not w for w in words):
            raise ValueError("bad_words must be a list of non-empty strings")


def check_vocab(params: TokenConstraintFields, vocab_size: int) -> None:
    """Token ids that the model cannot produce are refused by name."""
    for name, ids in (
        ("logit_bias", list(params.logit_bias or ())),
        ("allowed_token_ids", params.allowed_token_ids or ()),
    ):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ValueError(f"{name}: token ids out of the vocabulary [0, {vocab_size}): {bad[:5]}")
