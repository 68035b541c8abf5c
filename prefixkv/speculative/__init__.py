"""Speculative decoding (vLLM's `speculative_config`): a drafter proposes the tokens a request is
likely to produce next, one step computes them all, and the tokens the model would have produced
itself are kept (`accept.py`). Outputs are the same as without it: greedy ones token for token,
seeded ones too (each kept token was drawn from the uniform a step without drafts would use)."""

from .accept import keep_accepted, rewind_generators
from .budget import DraftBudget
from .config import SpeculativeConfig
from .drafter import Drafter
from .methods import DRAFTERS
from .ngram import NgramDrafter
from .stats import SpecDecodeStats

__all__ = [
    "DRAFTERS",
    "DraftBudget",
    "Drafter",
    "NgramDrafter",
    "SpecDecodeStats",
    "SpeculativeConfig",
    "keep_accepted",
    "rewind_generators",
]
