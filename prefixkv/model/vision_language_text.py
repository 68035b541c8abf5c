"""Vision-language checkpoints served text-only: the Llama decoder over their language model
(Mistral 3's checkpoints' language_model.model.* and language_model.lm_head, or transformers 5's
model.language_model.* and lm_head: Mistral 3, Qwen3-VL); the vision encoder and its projector
(Pixtral's vision_tower.* and multi_modal_projector.*, Qwen3-VL's visual.*, under model. or not;
Gemma 4's, its audio encoder too: `language_model_tensors`) are not loaded, and a request with
images is refused (the engine's text-only path)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch

from .llama import LlamaModel

logger = logging.getLogger(__name__)
# Pixtral's, Qwen3-VL's and Gemma 4's (with its audio encoder) encoders and projectors
_ENCODER_PARTS = ("vision_tower.", "multi_modal_projector.", "visual.", "audio_tower.", "embed_vision.", "embed_audio.")
_ENCODERS = tuple(prefix + part for prefix in ("", "model.") for part in _ENCODER_PARTS)
_LANGUAGE = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)


class VisionLanguageTextModel(LlamaModel):
    """LlamaModel, loading a vision-language checkpoint's language model."""

    # the routed experts stacked as [E, in, out] (Qwen3-VL-MoE's released layout, which transformers
    # transposes at load), not transformers' [E, out, in]
    experts_transposed = False

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        language = self._language_model(weights)
        super().load_hf_weights(self._experts_as_transformers(language) if self.experts_transposed else language)

    def _experts_as_transformers(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Stacked experts [E, H, 2I] / [E, I, H] as [E, 2I, H] / [E, H, I]; one already so
        (a width where the two read alike: H = 2I, or H = I, is taken as the release's) is left."""
        cfg = self.config
        H, I = cfg.hidden_size, cfg.moe_intermediate_size
        for name, t in weights:
            if t.dim() == 3 and (
                (name.endswith("mlp.experts.gate_up_proj") and t.shape[1:] == (H, 2 * I))
                or (name.endswith("mlp.experts.down_proj") and t.shape[1:] == (I, H))
            ):
                t = t.transpose(1, 2)
            yield name, t

    def _language_model(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        return language_model_tensors(weights, self.config.architecture)


def language_model_tensors(
    weights: Iterable[tuple[str, torch.Tensor]], architecture: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """A multimodal checkpoint's language-model tensors under the decoder's names; its encoders
    and projectors skipped (said once in the log)."""
    skipped = 0
    for name, t in weights:
        if name.startswith(_ENCODERS):
            skipped += 1
            continue
        for old, new in _LANGUAGE:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        yield name, t
    if skipped:
        logger.info(
            "%s: its language model is served text-only; the vision (and audio) encoders and projectors (%d "
            "tensors) are not loaded, and requests with images are refused",
            architecture,
            skipped,
        )


class Qwen3VLMoeTextModel(VisionLanguageTextModel):
    """Qwen3-VL-MoE's language model (Qwen3-MoE's decoder), its experts in the release's layout."""

    experts_transposed = True
