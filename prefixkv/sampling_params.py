"""SamplingParams with vLLM's field names, validated up front so bad values never reach the engine.

Every number must be finite and in its range (a NaN or an overflowing value would otherwise
surface mid-step); vLLM fields prefixkv does not implement are refused by name unless they have
their default value. The engine checks what depends on it (logprobs against max_logprobs) when a
request is added."""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

from .constraints.structured_params import StructuredOutputsParams
from .constraints.validation import check_token_fields, normalize_logit_bias

MAX_TEMPERATURE = 1e4  # beyond it sampling is uniform anyway; float('inf') or 1e308 would overflow
PENALTY_RANGE = (1e-4, 1e4)  # repetition_penalty: outside it the scaled logits overflow float32
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes (negative wraps)

# vLLM fields prefixkv does not implement: accepted only with the value that changes nothing.
_UNSUPPORTED: dict[str, Any] = {
    "best_of": None,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "early_stopping": False,
    "logits_processors": None,
    "guided_decoding": None,
    "spaces_between_special_tokens": True,
    "flat_logprobs": False,
}


class RequestOutputKind(Enum):
    """What each RequestOutput of a running request holds (vLLM's): everything so far, only what
    is new since the previous output, or nothing until the one final output. LLM.generate returns
    final outputs whatever the kind (it asks the engine for FINAL_ONLY, as vLLM does)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class RepetitionDetectionParams:
    """vLLM's: end a sequence whose output ends in a pattern of `min_pattern_size` to
    `max_pattern_size` tokens repeated `min_count` times in a row (finish_reason "repetition",
    stop_reason "repetition_detected"). `max_pattern_size` 0: off."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0  # 0: 1
    min_count: int = 0

    def __post_init__(self) -> None:
        for name in ("max_pattern_size", "min_pattern_size", "min_count"):
            _int(f"repetition_detection.{name}", getattr(self, name), 0)
        if self.min_pattern_size > self.max_pattern_size:
            raise ValueError(
                "repetition_detection: max_pattern_size and min_pattern_size must be >= 0, with min_pattern_size "
                "<= max_pattern_size (both 0: off)"
            )
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise ValueError("repetition_detection.min_count must be >= 2 (or max_pattern_size 0: off)")

    def repeats(self, token_ids: list[int]) -> bool:
        """Whether the tokens end in a pattern repeated `min_count` times (vLLM's check, which
        stops at the first length too long for the tokens there are)."""
        count = self.min_count
        for size in range(max(1, self.min_pattern_size), self.max_pattern_size + 1):
            if size * count > len(token_ids):
                return False
            if all(token_ids[-(size * m + n)] == token_ids[-n] for n in range(1, size + 1) for m in range(1, count)):
                return True
        return False


@functools.cache
def _log_extra_args_once() -> None:
    """extra_args change nothing here (no custom logits processor reads them): said once, not silently."""
    logging.getLogger("prefixkv").info("SamplingParams.extra_args accepted; nothing in prefixkv reads them")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # top-k per prompt position (plus the prompt token itself)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    detokenize: bool = True
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: max_model_len (vLLM)
    # prefixkv's extra (vLLM-Omni's stage hand-over): RequestOutput.hidden_states holds the final
    # hidden state of every position computed for the sequence - the prompt's, then each generated
    # token's but the last (never fed back) - for a downstream stage (prefixkv/pipeline/)
    return_hidden_states: bool = False
    # constraints on what may be sampled (prefixkv/constraints/)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: with a reasoning parser, at most this many reasoning tokens, then its end is forced
    # (-1: no limit)
    thinking_token_budget: int | None = None
    # vLLM's: end the output when its tail repeats a pattern (a dict of the same keys is taken)
    repetition_detection: RepetitionDetectionParams | None = None
    # vLLM's: a streamed output comes every this many tokens (the first and last at once); the
    # engine's stream_interval is the floor
    stream_interval: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # vLLM's free-form arguments for custom logits processors and plugins; nothing in prefixkv
    # reads them (as nothing in vLLM's own tree does): carried on the params, unchanged
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {type(self.stop).__name__}")
        self.stop = list(self.stop or [])
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of integers, got {type(self.stop_token_ids).__name__}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.repetition_detection, dict):
            try:
                self.repetition_detection = RepetitionDetectionParams(**self.repetition_detection)
            except TypeError as e:
                raise ValueError(f"repetition_detection: {e}") from None
        if self.thinking_token_budget == -1 and _is_int(self.thinking_token_budget):
            self.thinking_token_budget = None
        self.logit_bias = normalize_logit_bias(self.logit_bias)
        if isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, tuple):
            self.bad_words = list(self.bad_words)
        self.verify()

    def verify(self) -> None:
        """Raise ValueError naming the first bad field. The engine calls it again when a request
        is added: the dataclass is mutable."""
        _int("n", self.n, 1)
        _number("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}")
        _number("min_p", self.min_p, 0.0, 1.0)
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, 1)
        _int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, 0, what="a non-negative integer")
        if self.prompt_logprobs is not None:
            _int("prompt_logprobs", self.prompt_logprobs, 0, what="a non-negative integer")
        _number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _number("repetition_penalty", self.repetition_penalty, *PENALTY_RANGE)
        if any(not isinstance(s, str) or not s for s in self.stop):  # type: ignore[union-attr]
            raise ValueError("stop strings must be non-empty strings")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):  # type: ignore[union-attr]
            raise ValueError("stop_token_ids must be non-negative integers")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise ValueError(f"seed must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed!r}")
        if self.repetition_detection is not None and not isinstance(
            self.repetition_detection, RepetitionDetectionParams
        ):
            raise ValueError("repetition_detection must be a RepetitionDetectionParams or a dict of its fields")
        if self.stream_interval is not None:
            _int("stream_interval", self.stream_interval, 1)
        if self.thinking_token_budget is not None:
            _int("thinking_token_budget", self.thinking_token_budget, 0, what="a non-negative integer or -1 (no limit)")
        tpt = self.truncate_prompt_tokens
        if tpt is not None and (not _is_int(tpt) or (tpt < 1 and tpt != -1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 (the context length) or an integer >= 1, got {tpt!r}")
        for name in (
            "include_stop_str_in_output",
            "ignore_eos",
            "skip_special_tokens",
            "detokenize",
            "return_hidden_states",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")  # noqa: TRY004
        if self.return_hidden_states and self.n != 1:
            raise ValueError("return_hidden_states needs n=1 (one sequence's hidden states per request)")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")  # noqa: TRY004
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict or None, got {type(self.extra_args).__name__}")  # noqa: TRY004
        if self.extra_args:
            _log_extra_args_once()
        normalize_logit_bias(self.logit_bias)
        check_token_fields(self)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(  # noqa: TRY004
                    "structured_outputs must be a StructuredOutputsParams, got "
                    f"{type(self.structured_outputs).__name__}"
                )
            self.structured_outputs.verify()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def penalized(self) -> bool:
        """Whether a penalty reads the request's prompt and output so far."""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)

    def clone(self, **changes: Any) -> SamplingParams:
        values = {k: getattr(self, k) for k in self.__dataclass_fields__}
        values.update(changes)
        return SamplingParams(**values)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(name: str, value: Any, low: int, what: str | None = None) -> None:
    if not _is_int(value) or value < low:
        raise ValueError(f"{name} must be {what or f'an integer >= {low}'}, got {value!r}")


def _number(name: str, value: Any, low: float, high: float, low_open: bool = False) -> None:
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (low < value if low_open else low <= value)
        and value <= high
    )
    if not ok:
        raise ValueError(
            f"{name} must be a finite number in {'(' if low_open else '['}{low:g}, {high:g}], got {value!r}"
        )


_dataclass_init = SamplingParams.__init__


@functools.wraps(_dataclass_init)
def _init(self: SamplingParams, *args: Any, **kwargs: Any) -> None:
    # vLLM fields we do not implement: refused by name (a ValueError, not a silent no-op)
    for name in [k for k in kwargs if k in _UNSUPPORTED]:
        value = kwargs.pop(name)
        default = _UNSUPPORTED[name]
        if value is None or value == default or (name == "best_of" and value == kwargs.get("n", 1)):
            continue
        raise ValueError(f"SamplingParams {name}={value!r} is not supported by prefixkv")
    _dataclass_init(self, *args, **kwargs)


SamplingParams.__init__ = _init  # type: ignore[method-assign]


def truncate_prompt_tokens(ids: list[int], k: int | None, max_model_len: int, side: str = "left") -> list[int]:
    """The prompt's last `k` tokens (-1: max_model_len; None: all of them), as vLLM's
    truncate_prompt_tokens; its first `k` with `side` "right" (vLLM's truncation_side)."""
    if k is None:
        return ids
    k = max_model_len if k == -1 else k
    if len(ids) <= k:
        return ids
    return ids[:k] if side == "right" else ids[-k:]


LENGTH_PENALTY_RANGE = (-10.0, 10.0)  # a sequence length to a larger power overflows a float


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters (`LLM.beam_search`; `use_beam_search` on the server). The
    search keeps the `beam_width` best sequences by vLLM's score: cumulative log-probability over
    (prompt + output length, EOS not counted) ** length_penalty. As in vLLM, the scores are the
    model's raw log-probabilities: `temperature` is checked and changes nothing."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        """Raise ValueError naming the first bad field (again when a search starts: the dataclass
        is mutable)."""
        _int("beam_width", self.beam_width, 1)
        _int("max_tokens", self.max_tokens, 1)
        _number("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _number("length_penalty", self.length_penalty, *LENGTH_PENALTY_RANGE)
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")  # noqa: TRY004
        if self.structured_outputs is not None:
            raise ValueError("BeamSearchParams structured_outputs is not supported by prefixkv")
