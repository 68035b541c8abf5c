"""CLIP image preprocessing, reproduced with PIL and numpy step for step as transformers'
CLIPImageProcessor (PIL backend) does it, so the pixels - and the model's outputs - are the same:

1. convert to RGB (transparency composited onto white),
2. resize so the shortest edge is `size["shortest_edge"]` (the long edge truncated, as
   `int(short * long / short_in)`), or to `size["height"] x size["width"]`, with PIL's filter
   `resample` (bicubic for CLIP),
3. center crop to `crop_size` (zero padding where the image is smaller),
4. rescale: uint8 -> float64 * rescale_factor -> float32,
5. normalize: (x - mean) / std in float32, per channel.

The output is a (3, H, W) float32 array. transformers is only a test dependency (the test compares
every step's result with its processor on random images)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# The most pixels an image may have after resizing (PIL allocates it whole before the crop). With
# inputs at most 200:1 (inputs.MAX_IMAGE_ASPECT_RATIO) a shortest_edge up to 500 stays under it;
# only a checkpoint with a larger resize target refuses long images.
MAX_PROCESSED_PIXELS = 50_000_000


@dataclass
class ImageProcessor:
    size: dict[str, int] = field(default_factory=lambda: {"shortest_edge": 224})
    crop_size: dict[str, int] | None = field(default_factory=lambda: {"height": 224, "width": 224})
    do_resize: bool = True
    do_center_crop: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    resample: int = 3  # PIL.Image.Resampling.BICUBIC
    do_convert_rgb: bool = True

    def __post_init__(self) -> None:
        if self.do_resize and not ("shortest_edge" in self.size or {"height", "width"} <= set(self.size)):
            raise ValueError(f"unsupported image processor size {self.size!r} (shortest_edge or height and width)")
        if "longest_edge" in self.size:
            raise ValueError("an image processor size with longest_edge is not supported")
        if self.do_center_crop and (self.crop_size is None or not {"height", "width"} <= set(self.crop_size)):
            raise ValueError(f"unsupported crop_size {self.crop_size!r} (height and width)")
        self._mean = np.array(self.image_mean, dtype=np.float32)
        self._std = np.array(self.image_std, dtype=np.float32)

    @classmethod
    def from_hf_folder(cls, folder: str, default_image_size: int) -> ImageProcessor:
        """preprocessor_config.json (or processor_config.json's "image_processor"); without either,
        CLIP's defaults at the vision tower's image size."""
        d: dict[str, Any] = {}
        for name in ("preprocessor_config.json", "processor_config.json"):
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as f:
                    d = json.load(f)
                d = d.get("image_processor", d)
                break
        if not d:
            s = default_image_size
            return cls(size={"shortest_edge": s}, crop_size={"height": s, "width": s})
        kind = d.get("image_processor_type", "CLIPImageProcessor")
        if kind not in ("CLIPImageProcessor", "CLIPImageProcessorFast", "CLIPImageProcessorPil"):
            raise ValueError(f"unsupported image processor {kind!r} (CLIPImageProcessor only)")
        size = d.get("size", {"shortest_edge": default_image_size})
        if isinstance(size, int):
            size = {"shortest_edge": size}
        crop = d.get("crop_size", size if "height" in size else None)
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        return cls(
            size=dict(size),
            crop_size=dict(crop) if crop else None,
            do_resize=d.get("do_resize", True),
            do_center_crop=d.get("do_center_crop", True),
            do_rescale=d.get("do_rescale", True),
            rescale_factor=d.get("rescale_factor", 1 / 255),
            do_normalize=d.get("do_normalize", True),
            image_mean=tuple(d.get("image_mean") or OPENAI_CLIP_MEAN),
            image_std=tuple(d.get("image_std") or OPENAI_CLIP_STD),
            resample=int(d.get("resample", 3)),
            do_convert_rgb=d.get("do_convert_rgb", True),
        )

    @property
    def output_size(self) -> tuple[int, int] | None:
        """(height, width) of every output, when it does not depend on the input."""
        if self.do_center_crop and self.crop_size is not None:
            return self.crop_size["height"], self.crop_size["width"]
        if self.do_resize and "height" in self.size:
            return self.size["height"], self.size["width"]
        return None

    # -- the steps ---------------------------------------------------------------------------
    @staticmethod
    def to_rgb(image: Image.Image) -> Image.Image:
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, rgba).convert("RGB")
        return image.convert("RGB")

    def resize_to(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) an image of this size is resized to."""
        if "shortest_edge" in self.size:
            target = self.size["shortest_edge"]
            short, long = (width, height) if width <= height else (height, width)
            new_short, new_long = target, int(target * long / short)
            return (new_long, new_short) if width <= height else (new_short, new_long)
        return self.size["height"], self.size["width"]

    def check_size(self, height: int, width: int, what: str = "image") -> None:
        """ValueError when an image of this size would be resized past MAX_PROCESSED_PIXELS; called
        with the header's size, before the image is converted or resized."""
        if not self.do_resize:
            return
        h, w = self.resize_to(height, width)
        if h * w > MAX_PROCESSED_PIXELS:
            raise ValueError(
                f"{what} is {width}x{height} pixels; this model resizes it to {w}x{h}, and at most "
                f"{MAX_PROCESSED_PIXELS} pixels are accepted after resizing"
            )

    @staticmethod
    def center_crop(array: np.ndarray, height: int, width: int) -> np.ndarray:
        """(H, W, C) -> (height, width, C), zero-padded where smaller (as transformers does)."""
        h, w = array.shape[:2]
        top, left = (h - height) // 2, (w - width) // 2
        if top >= 0 and left >= 0 and top + height <= h and left + width <= w:
            return array[top : top + height, left : left + width]
        new_h, new_w = max(height, h), max(width, w)
        padded = np.zeros((new_h, new_w, *array.shape[2:]), dtype=array.dtype)
        top_pad, left_pad = math.ceil((new_h - h) / 2), math.ceil((new_w - w) / 2)
        padded[top_pad : top_pad + h, left_pad : left_pad + w] = array
        top, left = top + top_pad, left + left_pad
        return padded[max(0, top) : min(new_h, top + height), max(0, left) : min(new_w, left + width)]

    def __call__(self, image: Image.Image) -> np.ndarray:
        """One PIL image -> (3, H, W) float32 pixel values."""
        self.check_size(image.height, image.width)  # before to_rgb copies it
        if self.do_convert_rgb:
            image = self.to_rgb(image)
        elif image.mode != "RGB":
            raise ValueError(f"image mode {image.mode!r} needs do_convert_rgb")
        if self.do_resize:
            h, w = self.resize_to(image.height, image.width)
            image = image.resize((w, h), resample=Image.Resampling(self.resample))
        array: np.ndarray = np.asarray(image)
        if self.do_center_crop and self.crop_size is not None:
            array = self.center_crop(array, self.crop_size["height"], self.crop_size["width"])
        if self.do_rescale:
            out = (array.astype(np.float64) * self.rescale_factor).astype(np.float32)
        else:
            out = array.astype(np.float32)
        if self.do_normalize:
            out = (out - self._mean) / self._std
        return np.ascontiguousarray(out.transpose(2, 0, 1))
