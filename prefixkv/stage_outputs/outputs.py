"""What `LLM.embed` and `LLM.encode` return: vLLM's EmbeddingRequestOutput and
PoolingRequestOutput shapes."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PoolingOutput:
    data: torch.Tensor  # (D,) or, for ALL pooling, (num_tokens, D)


@dataclass
class EmbeddingOutput:
    embedding: list[float] | list[list[float]]  # ALL pooling: one vector per token

    @property
    def hidden_size(self) -> int:
        e = self.embedding
        return len(e[0]) if e and isinstance(e[0], list) else len(e)


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(
            out.request_id,
            EmbeddingOutput(out.outputs.data.tolist()),
            out.prompt_token_ids,
            out.finished,
            out.num_cached_tokens,
        )
