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
