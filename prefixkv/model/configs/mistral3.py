"""Ministral 3 (transformers' Ministral3ForCausalLM: Mistral's decoder with YaRN and Llama 4's
attention temperature) and the Mistral 3 vision-language checkpoints
(Mistral3ForConditionalGeneration: a Mistral or Ministral 3 language model under a Pixtral
encoder, served text-only here): their config.json reader."""

from __future__ import annotations

from typing import Any

from . import llama
from .family import ConfigFamily

VISION_LANGUAGE = "Mistral3ForConditionalGeneration"
_TEXT_ARCHITECTURES = {"mistral": "MistralForCausalLM", "ministral3": "Ministral3ForCausalLM"}


def _hf_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    if arch == VISION_LANGUAGE:
        text = dict(d.get("text_config") or {})
        if "tie_word_embeddings" in d:  # the outer config's, as transformers ties them
            text["tie_word_embeddings"] = d["tie_word_embeddings"]
        kind = text.get("model_type", "mistral")
        if kind not in _TEXT_ARCHITECTURES:
            raise ValueError(f"{arch} with a {kind!r} language model is not supported (mistral, ministral3)")
        return {**_text_fields(text, _TEXT_ARCHITECTURES[kind]), "architecture": arch}
    return _text_fields(d, arch)


def _text_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    """Mistral's fields (configs/llama.py); Ministral 3's YaRN is read there too, and its query
    temperature's length kept, below which the temperature is 1 (ModelConfig.exact_context)."""
    fields = llama.hf_fields(d, "MistralForCausalLM")
    fields["architecture"] = arch
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if rope.get("llama_4_scaling_beta"):
        fields["query_temperature_length"] = int(rope["original_max_position_embeddings"])
    return fields


FAMILY = ConfigFamily(
    architectures=("Ministral3ForCausalLM", VISION_LANGUAGE),
    hf_fields=_hf_fields,
    model_types={"ministral3": "Ministral3ForCausalLM", "mistral3": VISION_LANGUAGE},
)
