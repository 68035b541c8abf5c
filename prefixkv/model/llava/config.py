"""What a LLaVA-style checkpoint says about its vision side: the CLIP tower, the projector, the
feature layer and selection, the image token, and how many placeholder tokens one image takes."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from ..config import ModelConfig

# HF architecture names of the vision-language models prefixkv reads (config.json "architectures").
MULTIMODAL_ARCHITECTURES = ("LlavaForConditionalGeneration",)
_VISION_MODEL_TYPES = ("clip_vision_model",)
_TEXT_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


@dataclass
class VisionConfig:
    """A CLIP vision tower (transformers' CLIPVisionConfig)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> VisionConfig:
        mt = d.get("model_type", "clip_vision_model")
        if mt not in _VISION_MODEL_TYPES:
            raise ValueError(
                f"unsupported vision tower {mt!r}; supported: {', '.join(_VISION_MODEL_TYPES)} (LLaVA 1.5 style)"
            )
        return cls(
            hidden_size=d.get("hidden_size", 768),
            intermediate_size=d.get("intermediate_size", 3072),
            num_hidden_layers=d.get("num_hidden_layers", 12),
            num_attention_heads=d.get("num_attention_heads", 12),
            image_size=d.get("image_size", 224),
            patch_size=d.get("patch_size", 32),
            num_channels=d.get("num_channels", 3),
            hidden_act=d.get("hidden_act", "quick_gelu"),
            layer_norm_eps=d.get("layer_norm_eps", 1e-5),
        )


@dataclass
class LlavaConfig:
    """LLaVA 1.5: image -> CLIP tower -> hidden states of `vision_feature_layer` (a list: concatenated)
    -> drop the CLS row ("default") or keep it ("full") -> 2-layer MLP projector -> text embeddings."""

    text: ModelConfig
    vision: VisionConfig
    image_token_id: int
    vision_feature_layer: int | list[int] = -2
    vision_feature_select_strategy: str = "default"
    projector_hidden_act: str = "gelu"
    projector_bias: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(
                f"unsupported vision_feature_select_strategy {self.vision_feature_select_strategy!r} "
                "(supported: default, full)"
            )
        n = self.vision.num_hidden_layers
        for layer in self.feature_layers:
            if not -(n + 1) <= layer <= n:
                raise ValueError(f"vision_feature_layer {layer} is not a layer of a {n}-layer vision tower")

    @property
    def feature_layers(self) -> list[int]:
        fl = self.vision_feature_layer
        return [fl] if isinstance(fl, int) else list(fl)

    @property
    def tokens_per_image(self) -> int:
        """Placeholder tokens one image expands to: its patches, plus the CLS row with "full"."""
        return self.vision.num_patches + (1 if self.vision_feature_select_strategy == "full" else 0)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> LlavaConfig:
        text = dict(d.get("text_config") or {})
        mt = text.get("model_type", "llama")
        if not text.get("architectures"):
            if mt not in _TEXT_ARCHITECTURES:
                raise ValueError(
                    f"unsupported LLaVA language model {mt!r}; supported: {', '.join(_TEXT_ARCHITECTURES)}"
                )
            text["architectures"] = [_TEXT_ARCHITECTURES[mt]]
        token = d.get("image_token_index", d.get("image_token_id"))
        if token is None:
            raise ValueError("the LLaVA config names no image token (image_token_index)")
        return cls(
            text=ModelConfig.from_hf_dict(text),
            vision=VisionConfig.from_hf_dict(d.get("vision_config") or {}),
            image_token_id=int(token),
            vision_feature_layer=d.get("vision_feature_layer", -2),
            vision_feature_select_strategy=d.get("vision_feature_select_strategy", "default"),
            projector_hidden_act=d.get("projector_hidden_act", "gelu"),
            projector_bias=bool(d.get("multimodal_projector_bias", True)),
        )


def read_hf_config(folder: str) -> dict[str, Any]:
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def is_multimodal_config(d: dict[str, Any]) -> bool:
    archs = d.get("architectures") or []
    return bool(archs) and archs[0] in MULTIMODAL_ARCHITECTURES or d.get("model_type") == "llava"
