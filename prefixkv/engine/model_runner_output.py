"""What the model runner returns for one step (the runner -> scheduler boundary)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..tiers.plans import SavedBlock

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class PromptLogprobs:
    """Scores of prompt tokens `first`, `first + 1`, ... under the raw distribution of the
    positions before them: each token's logprob and rank (1 = best), and the top-k per position."""

    first: int
    logprobs: list[float]
    ranks: list[int]
    top: list[list[tuple[int, float]]]


@dataclass(slots=True)
class ModelRunnerOutput:
    """Row i of the sampled lists belongs to request `req_ids[i]`; requests whose sampling failed
    are in `errors` instead (they sampled nothing: the others of the batch are unharmed). A request
    that verified drafts has a row per token it gained, one after another (prefixkv/speculative)."""

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None  # logprob of each sampled token, when anyone asked
    ranks: list[int] | None = None  # rank of each sampled token (1 = best)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per row: (token, logprob), best first
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # prompt hidden states, for requests that asked: (first position, rows (n, D) on the CPU)
    hidden_states: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    # speculative decoding: per request that verified drafts, how many of them were kept
    accepted_drafts: dict[str, int] = field(default_factory=dict)
    # KV tiers: the values the worker half made of the step's saves (a tuple: nothing allocated without)
    kv_saved: Sequence[SavedBlock] = ()
