"""A user request as the engine keeps it: n sequences sampled from one admitted prompt."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..constraints.grammar import GrammarEngine
from ..constraints.token_constraints import RequestConstraints
from ..lora.request import LoRARequest
from ..model.tokenizer import Tokenizer
from ..outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from ..request import FINISHED_STATUSES, Request
from ..sampling_params import RequestOutputKind
from .input_processor import EngineRequest
from .output_processor import OutputState


@dataclass(slots=True)
class GivenOut:
    """What a sequence's DELTA outputs have given out so far: text characters, tokens, logprobs,
    and whether its finish."""

    chars: int = 0
    tokens: int = 0
    logprobs: int = 0
    finish: bool = False


@dataclass
class RequestGroup:
    """n sequences sampled from one prompt (they share its cached blocks)."""

    request_id: str  # the client's id (unique among live groups)
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    states: list[OutputState]
    arrival_time: float
    # [None, entry for prompt token 1, ...] while prompt logprobs are wanted (filled by child 0)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None
    hidden_states: list[torch.Tensor] | None = None  # prompt hidden states as they arrive, when asked
    # RequestOutputKind.DELTA: per sequence, what was already given out; None for the other kinds
    sent: list[GivenOut] | None = None
    lora_request: LoRARequest | None = None  # as the caller gave it (RequestOutput.lora_request)
    streamed_tokens: int = -1  # output tokens of all its sequences when it last gave an output (-1: none yet)

    @property
    def finished(self) -> bool:
        if self.error is not None:
            return True
        for child in self.children:  # a loop, not all(): read for every request every step
            if child.status not in FINISHED_STATUSES:
                return False
        return True

    @property
    def output_kind(self) -> RequestOutputKind:
        kind: RequestOutputKind = self.children[0].sampling_params.output_kind
        return kind

    def output(self, finished: bool | None = None, now: float | None = None) -> RequestOutput:
        """What the client sees of the group now: everything so far, or with
        RequestOutputKind.DELTA what is new since the previous output (then each output is given
        out once: call this only for an output that is delivered). `finished`: `self.finished`,
        and `now`: the time of the step's outputs, where the caller has them."""
        children = self.children
        first = children[0]
        if finished is None:
            finished = self.finished
        if len(children) == 1:  # most groups: no walk over the sequences, built every step when streamed
            first_token = first.first_token_time or None
            finished_time = (first.finished_time or 0.0) if finished else None
        else:
            first_token = min((c.first_token_time for c in children if c.first_token_time), default=None)
            finished_time = max((c.finished_time or 0.0) for c in children) if finished else None
        metrics = RequestMetrics(
            arrival_time=self.arrival_time,
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=first_token,
            last_token_time=time.time() if now is None else now,
            finished_time=finished_time,
            max_tokens=first.sampling_params.max_tokens if first.sampling_params is not None else None,
        )
        prompt_logprobs = self.prompt_logprobs
        if self.sent is not None and prompt_logprobs is not None:  # DELTA: given out once, with the first output
            self.prompt_logprobs = None
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=self._deltas()
            if self.sent is not None
            else [s.completion(c) for s, c in zip(self.states, self.children)],
            finished=finished,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            metrics=metrics,
            prompt_logprobs=prompt_logprobs,
            error=self.error,
            hidden_states=torch.cat(self.hidden_states) if finished and self.hidden_states else None,
            lora_request=self.lora_request,
        )

    def _deltas(self) -> list[CompletionOutput]:
        """DELTA: each sequence's text, tokens and logprobs since its previous output; a sequence
        with nothing new (and no new finish) is left out, as vLLM does."""
        assert self.sent is not None
        outs = []
        for state, child, sent in zip(self.states, self.children, self.sent):
            text, ids, lps = state.text, child.output_token_ids, state.logprobs
            ends = state.finish_reason is not None and not sent.finish
            if len(text) == sent.chars and len(ids) == sent.tokens and not ends:
                continue
            outs.append(
                CompletionOutput(
                    state.index,
                    text[sent.chars :],
                    list(ids[sent.tokens :]),
                    state.cumulative_logprob,
                    list(lps[sent.logprobs :]) if lps is not None else None,
                    state.finish_reason,
                    state.stop_reason,
                )
            )
            sent.chars, sent.tokens = len(text), len(ids)
            sent.logprobs = len(lps) if lps is not None else 0
            sent.finish = sent.finish or ends
        return outs


def arrival_of(arrival_time: float | None) -> float:
    """The request's arrival time: as given, or now."""
    if arrival_time is None:
        return time.time()
    if isinstance(arrival_time, (int, float)) and math.isfinite(arrival_time):
        return float(arrival_time)
    raise ValueError(f"arrival_time must be a finite number, got {arrival_time!r}")


def make_group(
    req: EngineRequest,
    lora: LoRARequest | None,
    lora_id: int,
    request_id: str,
    arrival: float,
    seq_ids: Iterator[int],
    tokenizer: Tokenizer,
    vocab_size: int,
    grammar_engine: GrammarEngine | None,
    reads_stage_outputs: bool,
) -> RequestGroup:
    """The group's n sequences: each with its seeded generator and its own walk of the grammar.
    `lora`, `lora_id`: the request's adapter, resolved, and its engine id (0: the base model).
    `grammar_engine`: needed when the request has a grammar. `reads_stage_outputs`: cache hits
    give their hidden states back (the stage-output cache is on), so prompt logprobs and hidden
    states need not skip the prefix cache."""
    params, ids = req.params, list(req.prompt_token_ids)
    children, states = [], []
    constraints = RequestConstraints.build(params, tokenizer, vocab_size, budget=req.thinking_budget)
    for i in range(params.n):
        # seed + i wraps modulo 2**64 (what torch takes): any valid seed works for any n
        gen = torch.Generator().manual_seed((params.seed + i) % 2**64) if params.seed is not None else None
        child = Request(
            f"seq-{next(seq_ids)}",
            ids,
            sampling_params=params,
            lora_request=lora,
            cache_salt=req.cache_salt,
            prompt=req.prompt,
            arrival_time=arrival,
            generator=gen,
            priority=req.priority,
            cache_priority=req.cache_priority,
            mm_items=req.mm_items,
        )
        child.lora_id = lora_id
        if req.grammar is not None:  # each sequence walks its own grammar
            assert grammar_engine is not None
            grammar = grammar_engine.matcher(req.grammar, req.grammar_gate)
            child.constraints = (
                constraints.shares_with(grammar)
                if constraints is not None
                else RequestConstraints(vocab_size, grammar=grammar)
            )
        else:  # a budget's count is each sequence's own
            child.constraints = constraints.shares_with(None) if constraints and constraints.budget else constraints
        children.append(child)
        states.append(OutputState(i, params, tokenizer, ids))
    group = RequestGroup(request_id, req.prompt, ids, children, states, arrival, lora_request=req.lora_request)
    if params.output_kind is RequestOutputKind.DELTA:
        group.sent = [GivenOut() for _ in children]
    hidden_from = req.hidden_states_from
    # the last position is always computed; others may be cache hits
    reads_prompt = params.prompt_logprobs is not None or (hidden_from is not None and hidden_from < len(ids) - 1)
    if params.prompt_logprobs is not None:
        group.prompt_logprobs = [None]
    if hidden_from is not None:
        group.hidden_states = []
        children[0].prompt_hidden_upto = hidden_from
    if reads_prompt:
        if reads_stage_outputs:
            children[0].reads_stage_outputs = True
        else:
            children[0].skip_prefix_cache_read = True
    return group
