"""SamplingParams with vLLM's field names, validated up front so bad values never reach the engine."""
from __future__ import annotations

from dataclasses import dataclass, field


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
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._verify()

    def _verify(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}")
        if not 0.0 <= self.temperature:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top_k must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            bad(f"logprobs must be a non-negative integer, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or isinstance(self.prompt_logprobs, bool)
                                                 or self.prompt_logprobs < 0):
            bad(f"prompt_logprobs must be a non-negative integer, got {self.prompt_logprobs!r}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop strings must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative integers")
        if self.seed is not None and not isinstance(self.seed, int):
            bad(f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self, **changes) -> "SamplingParams":
        values = {k: getattr(self, k) for k in self.__dataclass_fields__}
        values.update(changes)
        return SamplingParams(**values)
