"""Qwen3-VL (transformers' Qwen3VLForConditionalGeneration) served text-only: its language model is
Qwen3's decoder (model/vision_language_text.py loads it; the vision encoder is not loaded). Its
rotary is the interleaved multimodal one (`mrope_section`), whose three position streams are
equal over text: the plain rotary. The config.json reader reads the language model's
`text_config` as Qwen3's, the outer `tie_word_embeddings` winning as in transformers; the MoE
variant (Qwen3VLMoeForConditionalGeneration) is refused by name."""

from __future__ import annotations

from typing import Any

from . import llama
from .family import ConfigFamily

ARCHITECTURE = "Qwen3VLForConditionalGeneration"


def _hf_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    text = dict(d.get("text_config") or {})
    if "tie_word_embeddings" in d:
        text["tie_word_embeddings"] = d["tie_word_embeddings"]
    return {**llama.hf_fields(text, "Qwen3ForCausalLM"), "architecture": arch}


FAMILY = ConfigFamily(
    architectures=(ARCHITECTURE,),
    hf_fields=_hf_fields,
    model_types={"qwen3_vl": ARCHITECTURE},
    refused={
        "Qwen3VLMoeForConditionalGeneration": "Qwen3-VL's MoE checkpoints are not supported (its dense ones are, "
        "text-only)"
    },
)
