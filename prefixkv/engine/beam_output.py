"""What beam search returns: vLLM's BeamSearchSequence / BeamSearchOutput shapes."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..lora.request import LoRARequest
from ..outputs import Logprob


@dataclass
class BeamSearchSequence:
    """One beam. As in vLLM, `tokens` holds the prompt and then the generated tokens (the EOS
    that ended it included) and `logprobs` one entry per generated token: the top 2 * beam_width
    candidates of that step. `text` (the whole sequence decoded) is set on the returned beams."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    lora_request: LoRARequest | None = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (an EOS ended it) or "length"; vLLM leaves it None offline
    stop_reason: int | str | None = None  # the EOS token that ended it


@dataclass
class BeamSearchOutput:
    """The best `beam_width` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]
