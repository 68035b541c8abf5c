"""Qwen3-VL (transformers' Qwen3VLForConditionalGeneration) served text-only: its language model is
Qwen3's decoder (model/vision_language_text.py loads it; the vision encoder is not loaded). Its
rotary is the interleaved multimodal one (`mrope_section`), whose three position streams are
equal over text: the plain rotary. The config.json reader reads the language model's
`text_config` as Qwen3's, or for Qwen3VLMoeForConditionalGeneration as Qwen3-MoE's (its router
always renormalising the top k), the outer `tie_word_embeddings` winning as in transformers."""

from __future__ import annotations

from typing import Any

from . import llama, moe
from .family import ConfigFamily

DENSE, MOE = "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration"


def _hf_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    text = {"tie_word_embeddings": arch == MOE, **(d.get("text_config") or {})}  # (their text configs' defaults)
    if "tie_word_embeddings" in d:
        text["tie_word_embeddings"] = d["tie_word_embeddings"]
    if arch == MOE:
        fields = moe.FAMILY.hf_fields(text, "Qwen3MoeForCausalLM")
        fields["norm_topk_prob"] = True
    else:
        fields = llama.hf_fields(text, "Qwen3ForCausalLM")
    return {**fields, "architecture": arch}


FAMILY = ConfigFamily(
    architectures=(DENSE, MOE),
    hf_fields=_hf_fields,
    model_types={"qwen3_vl": DENSE, "qwen3_vl_moe": MOE},
)
