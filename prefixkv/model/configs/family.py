"""What a model family registers: the names it answers to and its readers."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# config.json, the architecture it names -> ModelConfig fields
HfReader = Callable[[dict[str, Any], str], dict[str, Any]]
# GGUF metadata, the file's tensor names, its `general.architecture`, the HF architecture that
# maps to -> ModelConfig fields (the fields every GGUF shares, configs/common.py, are added after)
GgufReader = Callable[[dict[str, Any], set[str], str, str], dict[str, Any]]


@dataclass(frozen=True)
class ConfigFamily:
    architectures: tuple[str, ...]  # HF `architectures` names
    hf_fields: HfReader
    # HF `model_type` -> architecture, for a config.json without `architectures`
    model_types: Mapping[str, str] = field(default_factory=dict)
    # GGUF `general.architecture` -> architecture; empty: no GGUF reader
    gguf_architectures: Mapping[str, str] = field(default_factory=dict)
    gguf_fields: GgufReader | None = None
    # near misses of this family refused with a reason of their own: architecture -> reason
    refused: Mapping[str, str] = field(default_factory=dict)
    # config.json's `quantization_config.quant_method`s its loader reads (others are refused)
    quantizations: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        named = set(self.model_types.values()) | set(self.gguf_architectures.values())
        if not named <= set(self.architectures):
            raise ValueError(f"a family maps names to architectures it does not list: {sorted(named)}")
        if bool(self.gguf_architectures) != (self.gguf_fields is not None):
            raise ValueError("a family with GGUF architectures needs a GGUF reader, and only it")
