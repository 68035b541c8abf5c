"""`speculative_config` as vLLM spells it, checked once: the n-gram method (prompt lookup) is
implemented; every other method, and any key that would change what runs, is refused by name.
(A new method: its drafter in methods.py's DRAFTERS, its name out of OTHER_METHODS; its own
keys in KNOWN_KEYS and fields here.)"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from .drafter import Drafter
from .methods import DRAFTERS

# vLLM's other methods: each needs a draft model, heads or layers this engine does not load
OTHER_METHODS = (
    "eagle",
    "eagle3",
    "medusa",
    "mlp_speculator",
    "draft_model",
    "mtp",
    "deepseek_mtp",
    "ernie_mtp",
    "qwen3_next_mtp",
    "mimo_mtp",
    "longcat_flash_mtp",
    "suffix",
)
logger = logging.getLogger("prefixkv")

# keys that change nothing here: accepted as vLLM accepts them, and logged once
NO_EFFECT_KEYS = {"enforce_eager": "the n-gram method runs no draft model to capture or not"}
_logged: set[str] = set()
KNOWN_KEYS = (
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "disable_by_batch_size",
    "by_measured_cost",
    *NO_EFFECT_KEYS,
)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """N-gram speculation: the last `prompt_lookup_max` down to `prompt_lookup_min` tokens of a
    sequence are looked up in its own earlier tokens (prompt and output), and the
    `num_speculative_tokens` that followed the latest match are proposed. `disable_by_batch_size`:
    no drafts while more requests than that are running (a full batch computes enough per step)."""

    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    disable_by_batch_size: int | None = None
    method: str = "ngram"
    # prefixkv's: a request gets the drafts that raise the step's expected tokens per second, by
    # this machine's measured step times (budget.py); False: every draft proposed, as vLLM
    by_measured_cost: bool = True

    def drafter(self, max_model_len: int) -> Drafter:
        """This method's drafter for a model of `max_model_len` tokens."""
        return DRAFTERS[self.method](self, max_model_len)

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """vLLM's dict (or None: off); ValueError naming what is not implemented or not valid."""
        if value is None:
            return None
        if isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        unknown = sorted(set(value) - set(KNOWN_KEYS))
        if unknown:
            raise ValueError(f"speculative_config keys {unknown} are not implemented (known: {', '.join(KNOWN_KEYS)})")
        for key in sorted(set(value) & set(NO_EFFECT_KEYS) - _logged):
            _logged.add(key)
            logger.info("speculative_config %s changes nothing here: %s", key, NO_EFFECT_KEYS[key])
        method = value.get("method")
        model = value.get("model")
        if method is None and model in ("ngram", "[ngram]"):
            method = "ngram"  # vLLM's older spelling: the method as the model
        elif model is not None and model not in ("ngram", "[ngram]"):
            raise ValueError(
                f"speculative_config model={model!r}: draft models are not implemented (method 'ngram' needs none)"
            )
        if method == "[ngram]":
            method = "ngram"
        implemented = ", ".join(repr(m) for m in DRAFTERS)
        if method in OTHER_METHODS:
            raise ValueError(f"speculative_config method={method!r} is not implemented (only {implemented})")
        if method not in DRAFTERS:
            raise ValueError(f"speculative_config method={method!r} is unknown (implemented: {implemented})")
        k = value.get("num_speculative_tokens")
        if not _positive_int(k):
            raise ValueError(f"speculative_config num_speculative_tokens must be an integer >= 1, got {k!r}")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        # vLLM's defaults: 5 and 5, or the one given for both
        if lo is None and hi is None:
            lo = hi = 5
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        for name, n in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not _positive_int(n):
                raise ValueError(f"speculative_config {name} must be an integer >= 1, got {n!r}")
        assert isinstance(lo, int) and isinstance(hi, int) and isinstance(k, int)  # checked above
        if lo > hi:
            raise ValueError(f"speculative_config prompt_lookup_min ({lo}) > prompt_lookup_max ({hi})")
        off_at = value.get("disable_by_batch_size")
        if off_at is not None and not _positive_int(off_at):
            raise ValueError(f"speculative_config disable_by_batch_size must be an integer >= 1, got {off_at!r}")
        measured = value.get("by_measured_cost", True)
        if not isinstance(measured, bool):
            raise ValueError(f"speculative_config by_measured_cost must be true or false, got {measured!r}")
        return cls(k, lo, hi, off_at, method, measured)


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1
