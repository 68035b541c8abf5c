"""Pooling a prompt's final hidden states into an embedding (vLLM's pooling types for decoder
models: LAST is vLLM's default for them, MEAN, CLS = the first token, ALL = one vector per token)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where pooling runs: the CLI reads --pooler-config without torch
    import torch

POOLING_TYPES = ("last", "mean", "cls", "all")


@dataclass(frozen=True)
class PoolingParams:
    """How a prompt becomes an embedding: `pooling` one of POOLING_TYPES (case-insensitive, vLLM
    spells them LAST / MEAN / CLS / ALL), `normalize` L2-normalizes each pooled vector, and
    `dimensions` (vLLM's Matryoshka option) is refused: no model here is trained for it."""

    pooling: str = "last"
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.pooling, str) or self.pooling.lower() not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_TYPES)}, got {self.pooling!r}")
        object.__setattr__(self, "pooling", self.pooling.lower())
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a boolean, got {self.normalize!r}")
        if self.dimensions is not None:
            raise ValueError(
                "dimensions is not supported by prefixkv: no loaded model is trained for Matryoshka output"
            )

    @property
    def first_position(self) -> int:
        """0, or -1 for LAST: only the last position's hidden state is needed."""
        return -1 if self.pooling == "last" else 0


def pool(hidden: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """`hidden`: the prompt's final hidden states `(num_tokens, D)` (for LAST, at least the last
    row). Returns `(D,)`, or `(num_tokens, D)` for ALL; float32."""
    import torch

    h = hidden.float()
    kind = params.pooling
    if kind == "last":
        out = h[-1]
    elif kind == "cls":
        out = h[0]
    elif kind == "mean":
        out = h.mean(dim=0)
    else:
        out = h
    if params.normalize:
        out = torch.nn.functional.normalize(out, p=2, dim=-1)
    return out


# vLLM's PoolerConfig keys that prefixkv applies; the others are refused by name
_POOLER_KEYS = ("pooling_type", "normalize", "use_activation")


def parse_pooler_config(value: dict[str, Any] | str | None) -> PoolingParams:
    """vLLM's `--pooler-config` / `pooler_config=` (a dict or its JSON text), e.g.
    `{"pooling_type": "MEAN", "normalize": false}`: the engine's default pooling for
    `LLM.embed` / `LLM.encode`, /v1/embeddings and /pooling. `use_activation` is vLLM's newer name
    for `normalize` on embedding models. None: LAST pooling, normalized (vLLM's default for
    decoder models)."""
    if value is None:
        return PoolingParams()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"pooler_config is not valid JSON: {value!r} ({e})") from e
    if not isinstance(value, dict):
        raise ValueError(f"pooler_config must be a JSON object, got {value!r}")
    unknown = sorted(set(value) - set(_POOLER_KEYS))
    if unknown:
        raise ValueError(
            f"pooler_config keys {unknown} are not supported by prefixkv (supported: {', '.join(_POOLER_KEYS)})"
        )
    if "normalize" in value and "use_activation" in value and value["normalize"] != value["use_activation"]:
        raise ValueError("pooler_config: normalize and use_activation disagree; give one")
    normalize = value.get("normalize", value.get("use_activation"))
    return PoolingParams(value.get("pooling_type") or "last", True if normalize is None else normalize)
