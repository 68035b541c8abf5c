"""A tiny random LLaVA checkpoint (built once per session), test images, and transformers' reference."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from .llava_builder import build_llava


@pytest.fixture(scope="session")
def llava(tmp_path_factory):
    """(folder, transformers' model)."""
    folder = tmp_path_factory.mktemp("llava")
    model = build_llava(folder)
    return str(folder), model


def make_image(seed: int, size: tuple[int, int] = (40, 48), mode: str = "RGB") -> Image.Image:
    """A smooth random image (smooth, so that JPEG re-encoding changes little, as with photos)."""
    rng = np.random.default_rng(seed)
    w, h = size
    small = rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8)
    img = Image.fromarray(small, "RGB").resize((w, h), Image.Resampling.BICUBIC)
    noise = rng.integers(-6, 7, size=(h, w, 3))
    arr = np.clip(np.asarray(img).astype(int) + noise, 0, 255).astype(np.uint8)
    return Image.fromarray(arr, "RGB").convert(mode)


def make_shapes_image(seed: int, size: tuple[int, int] = (128, 96)) -> Image.Image:
    """Flat shapes on a background: structure a perceptual hash keeps through JPEG re-compression."""
    from PIL import ImageDraw

    rng = np.random.default_rng(seed)
    img = Image.new("RGB", size, tuple(int(x) for x in rng.integers(0, 256, 3)))
    draw = ImageDraw.Draw(img)
    for _ in range(6):
        x0, y0 = rng.integers(0, size[0] - 20), rng.integers(0, size[1] - 20)
        w, h = rng.integers(15, 60, 2)
        color = tuple(int(x) for x in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([x0, y0, x0 + w, y0 + h], fill=color)
    return img
