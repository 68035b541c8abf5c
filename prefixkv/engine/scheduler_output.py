"""What the scheduler hands the model runner for one step (one class per concept: this file is
the scheduler -> runner boundary)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..tiers.plans import KVLoad, KVSave

if TYPE_CHECKING:
    import torch

    from ..sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class EncoderInput:
    """A multimodal item's share of one chunk: rows `rows[0]:rows[1]` of its encoder output are the
    embeddings of the chunk's tokens `dest`, `dest + 1`, ... (an item may span several chunks, and a
    prefix hit may have covered its first rows already)."""

    identifier: str  # the item's identity (multimodal/hashing.py)
    data: Any  # the encoder's input (preprocessed pixels)
    rows: tuple[int, int]
    dest: int
    # the request's cache_salt: with the identity, the encoder cache's key, so that a salted
    # request never reads an encoder output computed for another salt (multimodal/encoder_cache.py)
    cache_salt: str | None = None

    @property
    def cache_key(self) -> tuple[str, str | None]:
        return (self.identifier, self.cache_salt)


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: compute `token_ids` at positions `start`, `start + 1`, ...
    into the KV blocks of `block_table`, then (when `sample` is set) sample its next token.

    The token lists are the request's own (not copies): the runner only reads them."""

    req_id: str  # engine-private, unique by construction (never a client's string)
    token_ids: list[int]  # this step's chunk
    start: int  # position of token_ids[0]; tokens before it are in the KV cache already
    block_table: list[int]
    sample: bool  # the chunk ends at the last known token: sample the next one
    sampling_params: SamplingParams
    generator: torch.Generator | None  # the request's seeded generator, None: the engine's default
    prompt_token_ids: list[int]  # penalties and prompt logprobs read them
    output_token_ids: list[int]
    block_eos: bool = False  # min_tokens not reached: EOS may not be drawn
    constraints: Any = None  # prefixkv.constraints.RequestConstraints: applied to the sampled row
    # The runner needs this chunk's final hidden states (prompt logprobs, returned hidden states).
    want_hidden_states: bool = False
    prompt_logprobs_from: int = 0  # the first prompt token whose logprob is still unknown
    # return hidden states from this position on (None: not wanted): the prompt's, and with
    # return_hidden_states every computed position's
    prompt_hidden_from: int | None = None
    # Per-request inputs that features attach to a step.
    lora_id: int = 0  # 0: the base model
    mm_inputs: tuple[EncoderInput, ...] = ()  # multimodal items (or parts of them) in this chunk
    # block ids whose cached stage outputs (hidden states) are read back: whole blocks ending at `start`
    stage_output_reads: tuple[Any, ...] = ()


@dataclass(slots=True)
class SchedulerOutput:
    """One step: the scheduled requests in batch order, and the requests that left since the
    previous step (so a runner that keeps per-request state can drop it)."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)
    # KV tiers (prefixkv/tiers): blocks to fill from tier bytes before the forward, and blocks
    # completed by this step's forward to copy out after it
    kv_loads: list[KVLoad] = field(default_factory=list)
    kv_saves: list[KVSave] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.scheduled)
