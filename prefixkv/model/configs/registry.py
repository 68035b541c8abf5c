"""Which family reads which architecture: HF `architectures` (or `model_type`) and GGUF
`general.architecture` -> the family's reader -> ModelConfig fields. A new family is a file beside
this one defining its ConfigFamily, and a line in FAMILIES (its decoder class: model/families.py)."""

from __future__ import annotations

from typing import Any

from . import (
    bamba,
    deepseek,
    falcon_h1,
    gemma,
    gemma4,
    glm4,
    glm4_moe,
    gpt_oss,
    granite_hybrid,
    lfm2,
    llama,
    mamba2,
    minimax_m2,
    mistral3,
    moe,
    olmo2,
    phi3,
    qwen3_next,
    qwen3_vl,
)
from .common import gguf_common_fields, join_fields
from .family import ConfigFamily

FAMILIES: tuple[ConfigFamily, ...] = (
    llama.FAMILY,
    gemma.FAMILY,
    gemma4.FAMILY,
    moe.FAMILY,
    mamba2.FAMILY,
    bamba.FAMILY,
    falcon_h1.FAMILY,
    qwen3_next.FAMILY,
    gpt_oss.FAMILY,
    olmo2.FAMILY,
    phi3.FAMILY,
    lfm2.FAMILY,
    granite_hybrid.FAMILY,
    mistral3.FAMILY,
    glm4.FAMILY,
    glm4_moe.FAMILY,
    minimax_m2.FAMILY,
    deepseek.FAMILY,
    qwen3_vl.FAMILY,
)


def _table(pairs: list[tuple[str, Any]], what: str) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for name, value in pairs:
        if name in table:
            raise ValueError(f"two families register the {what} {name!r}")
        table[name] = value
    return table


_BY_ARCHITECTURE: dict[str, ConfigFamily] = _table([(a, f) for f in FAMILIES for a in f.architectures], "architecture")
_BY_GGUF_ARCHITECTURE: dict[str, ConfigFamily] = _table(
    [(g, f) for f in FAMILIES for g in f.gguf_architectures], "GGUF architecture"
)
_MODEL_TYPES: dict[str, str] = _table([t for f in FAMILIES for t in f.model_types.items()], "model_type")
_REFUSED: dict[str, str] = _table([r for f in FAMILIES for r in f.refused.items()], "refused architecture")

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_BY_ARCHITECTURE)
# GGUF `general.architecture` -> HF architecture name
GGUF_ARCHITECTURES: dict[str, str] = {g: a for f in FAMILIES for g, a in f.gguf_architectures.items()}


def check_architecture(name: str) -> str:
    if name in _REFUSED:
        raise ValueError(f"Unsupported model architecture {name!r}: {_REFUSED[name]}")
    if name not in _BY_ARCHITECTURE:
        raise ValueError(
            f"Unsupported model architecture {name!r}; supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return name


def hf_fields(d: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields from an HF config.json's contents, by its first architecture (or, where
    it names none, its `model_type`)."""
    archs = d.get("architectures") or []
    if not archs:
        mt: Any = d.get("model_type")  # whatever config.json holds, named in the error
        archs = [_MODEL_TYPES.get(mt, f"<model_type {mt!r}>")]
    arch = check_architecture(archs[0])
    family = _BY_ARCHITECTURE[arch]
    quantization = d.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        if method not in family.quantizations:
            reads = f" (it reads {', '.join(family.quantizations)})" if family.quantizations else ""
            raise ValueError(
                f"quantization_config with quant_method {method!r} is not supported for {arch}{reads}: "
                "prefixkv loads unquantized checkpoints (float32, bfloat16, float16) and GGUF files"
            )
    return family.hf_fields(d, arch)


def gguf_fields(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """ModelConfig fields from a GGUF file's metadata and tensor names."""
    g_arch = meta.get("general.architecture")
    family = _BY_GGUF_ARCHITECTURE.get(g_arch) if isinstance(g_arch, str) else None
    if not isinstance(g_arch, str) or family is None or family.gguf_fields is None:
        raise ValueError(
            f"Unsupported GGUF architecture {g_arch!r}; supported GGUF architectures: "
            f"{', '.join(GGUF_ARCHITECTURES)} (HF: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    common = gguf_common_fields(meta, tensor_names, g_arch)
    return join_fields(common, family.gguf_fields(meta, tensor_names, g_arch, GGUF_ARCHITECTURES[g_arch]))
