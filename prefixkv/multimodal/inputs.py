"""A prompt's images -> placeholder tokens and multimodal items.

The prompt names each image with one image token (`<image>` for LLaVA); each is expanded to the
image's `tokens_per_image` placeholder tokens, and the image becomes a `MultiModalItem` at that
offset with that length (sorted by offset, as the prompt orders them), named by its identity
(hashing.py) and carrying its preprocessed pixels for the encoder."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image

from ..model.llava.loader import MultiModalModel
from .hashing import item_identity, require_phash
from .item import MultiModalItem

MAX_IMAGE_PIXELS = 50_000_000  # a larger image is refused before it is decoded (decompression bombs)
# Longest edge over shortest edge. Resizing scales the short edge up to the model's size, so a 1 x N
# strip of a few hundred bytes would become size x (N * size) pixels (1 x 300,000 at 224: +2.6 GB);
# the pixel count alone does not catch it. 200 is vLLM's bound for Qwen2-VL; past it a center crop
# keeps under 0.5 % of the image anyway.
MAX_IMAGE_ASPECT_RATIO = 200
MODALITIES = ("image",)


def load_image(obj: Any, what: str = "image") -> Image.Image:
    """A PIL image, or encoded image bytes -> a fully decoded PIL image; ValueError otherwise."""
    img: Image.Image
    if isinstance(obj, (bytes, bytearray, memoryview)):
        try:
            img = Image.open(io.BytesIO(bytes(obj)))
        except Exception as e:  # noqa: BLE001 (any decoder failure is the caller's bad input)
            raise ValueError(f"{what} cannot be decoded as an image: {type(e).__name__}: {e}") from None
    elif isinstance(obj, Image.Image):
        img = obj
    else:
        raise ValueError(f"{what} must be a PIL image or encoded image bytes, got {type(obj).__name__}")
    # Image.open reads the header only: both bounds hold before a pixel is decoded.
    if img.width * img.height > MAX_IMAGE_PIXELS or img.width < 1 or img.height < 1:
        raise ValueError(f"{what} is {img.width}x{img.height} pixels; at most {MAX_IMAGE_PIXELS} pixels are accepted")
    if max(img.width, img.height) > MAX_IMAGE_ASPECT_RATIO * min(img.width, img.height):
        raise ValueError(
            f"{what} is {img.width}x{img.height} pixels: an aspect ratio (longest over shortest edge) of "
            f"at most {MAX_IMAGE_ASPECT_RATIO} is accepted, so that resizing it for the model stays bounded"
        )
    try:
        img.load()
    except Exception as e:  # noqa: BLE001 (truncated or corrupt data)
        raise ValueError(f"{what} cannot be decoded as an image: {type(e).__name__}: {e}") from None
    return img


def images_of(multi_modal_data: Any) -> list[Any]:
    """The images of a prompt's `multi_modal_data` ({"image": one or a list}); other modalities refused."""
    if not isinstance(multi_modal_data, dict):
        raise ValueError(
            f"multi_modal_data must be a dict such as {{'image': image}}, got {type(multi_modal_data).__name__}"
        )
    for key in multi_modal_data:
        if key not in MODALITIES:
            raise ValueError(f"multi_modal_data[{key!r}] is not supported by prefixkv: only images ('image')")
    images = multi_modal_data.get("image")
    if images is None:
        return []
    return list(images) if isinstance(images, (list, tuple)) else [images]


class MultiModalInputProcessor:
    """Expands a prompt's image tokens and builds its items; stateless (safe from any thread)."""

    def __init__(self, mm: MultiModalModel, hash_mode: str = "exact", max_images: int | None = None) -> None:
        if hash_mode == "phash":
            require_phash()
        self.mm = mm
        self.hash_mode = hash_mode
        self.max_images = max_images

    def __call__(self, token_ids: Sequence[int], multi_modal_data: Any) -> tuple[list[int], tuple[MultiModalItem, ...]]:
        images = images_of(multi_modal_data) if multi_modal_data is not None else []
        token = self.mm.image_token_id
        positions = [i for i, t in enumerate(token_ids) if t == token]
        if self.max_images is not None and len(images) > self.max_images:
            raise ValueError(
                f"{len(images)} images in one prompt; this engine takes at most {self.max_images} "
                "(limit_mm_per_prompt / --limit-mm-per-prompt)"
            )
        if len(positions) != len(images):
            raise ValueError(
                f"the prompt has {len(positions)} image tokens ({self.mm.config.image_token_id}) but "
                f"{len(images)} images were given: put one image token per image in the prompt"
            )
        if not images:
            return list(token_ids), ()
        n = self.mm.tokens_per_image
        ids: list[int] = []
        items = []
        prev = 0
        for k, (pos, obj) in enumerate(zip(positions, images)):
            img = load_image(obj, f"image {k}")
            # before to_rgb copies it and the processor resizes it
            self.mm.processor.check_size(img.height, img.width, f"image {k}")
            rgb = self.mm.processor.to_rgb(img)
            pixels = self.mm.processor(rgb)
            ids.extend(token_ids[prev:pos])
            offset = len(ids)
            ids.extend([token] * n)
            prev = pos + 1
            ident = item_identity(self.hash_mode, rgb, pixels)
            items.append(MultiModalItem(ident, offset, n, torch.from_numpy(pixels)))
        ids.extend(token_ids[prev:])
        return ids, tuple(items)
