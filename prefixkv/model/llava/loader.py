"""Loading a LLaVA-style HF folder: the language model is prefixkv's decoder (model/llama.py), the
vision tower and projector are vision.py's, the image preprocessing is processor.py's."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from ..llama import LlamaModel
from ..tokenizer import Tokenizer
from .config import LlavaConfig, read_hf_config
from .processor import ImageProcessor
from .vision import VisionEncoder

_TOP = ("vision_tower.", "language_model.", "multi_modal_projector.")


@dataclass
class MultiModalModel:
    """What the engine needs besides the decoder: the encoder, the preprocessing, the image token."""

    config: LlavaConfig
    encoder: VisionEncoder
    processor: ImageProcessor

    @property
    def image_token_id(self) -> int:
        return self.config.image_token_id

    @property
    def tokens_per_image(self) -> int:
        return self.config.tokens_per_image


def split_llava_name(name: str) -> tuple[str, str]:
    """("text" | "vision", name as the decoder / VisionEncoder load it) for a LLaVA tensor name.
    Both layouts are read: llava-hf's (language_model.model.*, language_model.lm_head.*,
    vision_tower.vision_model.*) and transformers 5's (model.language_model.*, lm_head.*,
    model.vision_tower.*)."""
    if name.startswith("model.") and name[len("model.") :].startswith(_TOP):
        name = name[len("model.") :]
    if name.startswith("vision_tower."):
        rest = name[len("vision_tower.") :]
        return "vision", rest[len("vision_model.") :] if rest.startswith("vision_model.") else rest
    if name.startswith("multi_modal_projector."):
        return "vision", "projector." + name[len("multi_modal_projector.") :]
    if name.startswith("language_model."):
        rest = name[len("language_model.") :]
        if rest.startswith(("model.", "lm_head.")):
            return "text", rest
        return "text", "model." + rest
    return "text", name


def load_llava(
    folder: str, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, device: torch.device | str
) -> tuple[LlamaModel, Tokenizer, MultiModalModel]:
    config = LlavaConfig.from_hf_dict(read_hf_config(folder))
    tokenizer = Tokenizer.from_hf_folder(folder, extra_eos_ids=config.text.eos_token_id)
    if not 0 <= config.image_token_id < config.text.vocab_size:
        raise ValueError(f"image token id {config.image_token_id} is outside the vocabulary")
    processor = ImageProcessor.from_hf_folder(folder, config.vision.image_size)
    size = config.vision.image_size
    if processor.output_size != (size, size):
        raise ValueError(
            f"the image processor makes {processor.output_size} images; the vision tower takes {size}x{size}"
        )
    lm = LlamaModel(config.text, dtype=dtype, device=device)
    encoder = VisionEncoder(config, dtype, device)
    vision: list[tuple[str, torch.Tensor]] = []

    def text_weights() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in weights:
            part, local = split_llava_name(name)
            if part == "vision":
                vision.append((local, t))
            else:
                yield local, t

    lm.load_hf_weights(text_weights())
    encoder.load_hf_weights(vision)
    for p in encoder.parameters():
        p.requires_grad_(False)
    encoder.eval()
    return lm, tokenizer, MultiModalModel(config, encoder, processor)
