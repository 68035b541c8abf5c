"""The drafters by method: a new method is a module beside ngram.py and one entry here (its keys
are the methods `SpeculativeConfig` accepts; its fields are the config's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .drafter import Drafter
from .ngram import NgramDrafter

# method -> (the parsed SpeculativeConfig, the model's length) -> its drafter
DRAFTERS: dict[str, Callable[[Any, int], Drafter]] = {
    "ngram": lambda c, max_model_len: NgramDrafter(
        c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max, c.disable_by_batch_size, max_model_len
    ),
}
