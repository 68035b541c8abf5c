"""What generate() returns: vLLM's RequestOutput / CompletionOutput shapes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" (also on error) | None while running
    stop_reason: int | str | None = None  # the stop string or token that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    max_tokens: int | None = None  # what the request asked for (its SamplingParams.max_tokens)

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # vLLM's shape: None for the first prompt token, then {token id: Logprob} per position
    prompt_logprobs: list[dict[int, Logprob] | None] | None = field(default=None, repr=False)
    # Set when the request failed alone (finished=True, finish_reason "abort", as vLLM v1 reports
    # errored requests): the message says why. The other requests of the step are unharmed.
    error: str | None = None
    # When asked (`hidden_states_from`): the prompt's final hidden states from that position to its
    # end, (num_rows, hidden_size) on the CPU in the model dtype; set once the request is finished.
    # With SamplingParams(return_hidden_states=True): every position's, prompt then output, i.e.
    # (num_prompt_tokens + num_output_tokens - 1, hidden_size).
    hidden_states: Any = field(default=None, repr=False)
    # the request's LoRARequest (prefixkv/lora/request.py; a layer above this module), None for the base model
    lora_request: Any = None
