"""What the scheduler hands the model runner for one step (one class per concept: this file is
the scheduler -> runner boundary)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..multimodal.encoder_input import EncoderInput
from ..tiers.plans import KVLoad, KVSave

if TYPE_CHECKING:
    import torch

    from ..sampling_params import SamplingParams


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
    # a hybrid model's KV-cache groups after the first: a block table each (0 where a block was
    # released, out of the group's window)
    group_block_tables: list[list[int]] = field(default_factory=list)
    # block ids whose cached stage outputs (hidden states) are read back: whole blocks ending at `start`
    stage_output_reads: tuple[Any, ...] = ()
    # async scheduling: the one input token is the one the previous step is sampling for this
    # request (`token_ids` holds a stand-in); the runner takes it from that step's draws
    input_from_previous: bool = False
    # speculative decoding: the last len(draft_token_ids) of `token_ids` are drafts; a row is
    # sampled after each of them and after the token before them (prefixkv/speculative)
    draft_token_ids: Sequence[int] = ()

    def next_decode(
        self,
        start: int,
        block_table: list[int],
        block_eos: bool,
        prompt_logprobs_from: int,
        group_block_tables: list[list[int]],
    ) -> ScheduledRequest:
        """The same request's next step scheduled ahead (async scheduling): one token at `start`,
        the one this step samples (`input_from_previous`), sampled for in turn. What a request's
        decode step changes is passed in; the rest is this step's - a decode reads no stage
        outputs or images (the step in flight computes the rows before it). With
        return_hidden_states it keeps the hidden state of its position, as every step of it does.

        Built positionally: at batch 256 the keyword call took 1.5 us a request and this 0.6 (a
        2-vCPU AMD EPYC Zen 3); a test in tests/engine/test_scheduler.py holds the field order to it."""
        hidden = self.prompt_hidden_from is not None and self.sampling_params.return_hidden_states
        return ScheduledRequest(
            self.req_id,
            [0],  # a stand-in: the runner reads the token from the step in flight
            start,
            block_table,
            True,
            self.sampling_params,
            self.generator,
            self.prompt_token_ids,
            self.output_token_ids,
            block_eos,
            self.constraints,
            hidden,
            prompt_logprobs_from,
            start if hidden else None,
            self.lora_id,
            (),
            group_block_tables,
            (),
            True,
        )


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
    num_draft_tokens: int = 0  # speculative decoding: drafts among the scheduled tokens

    def __bool__(self) -> bool:
        return bool(self.scheduled)
