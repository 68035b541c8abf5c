"""Item identity: what an image's cache entries (KV block keys, encoder outputs) are named by.

- "exact" (default): sha256 of the pixel tensor the model sees (after preprocessing: resize, crop,
  normalize), with its shape and dtype. Two images are one item exactly when the model would see
  the same pixels - e.g. the same picture at two file formats that decode to the same RGB, or two
  sizes that resize to the same pixels - and nothing else can ever share their entries.
- "phash" (opt-in): imagehash's 64-bit DCT perceptual hash of the image (converted to RGB, then, as
  imagehash does, to 8-bit grayscale resized to 32x32 with Lanczos). Two images are one item exactly
  when these 64 bits are equal (Hamming distance 0), so a re-compressed or resized copy usually
  hits - and then it gets the first image's KV blocks and encoder output, which can change outputs.

In both modes an identity is shared only within one `cache_salt`: the encoder cache is keyed by
(identity, salt) (encoder_cache.py) and KV blocks carry the salt through their chain.
"""

from __future__ import annotations

import hashlib

import numpy as np
from PIL import Image

MM_HASH_MODES = ("exact", "phash")


def exact_identity(pixels: np.ndarray) -> str:
    h = hashlib.sha256()
    h.update(f"{pixels.dtype.str}{pixels.shape}".encode())
    h.update(np.ascontiguousarray(pixels).tobytes())
    return "sha256:" + h.hexdigest()


def require_phash() -> None:
    """`mm_hash="phash"` needs imagehash (and scipy), the `phash` extra: refused at start-up without it."""
    try:
        import imagehash  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "mm_hash='phash' (--mm-hash phash) needs the imagehash package: pip install 'prefixkv[phash]'"
        ) from e


def perceptual_identity(image: Image.Image) -> str:
    import imagehash

    return "phash:" + str(imagehash.phash(image))


def item_identity(mode: str, image: Image.Image, pixels: np.ndarray) -> str:
    """`image` as converted to RGB (before resizing), `pixels` as preprocessed."""
    if mode == "exact":
        return exact_identity(pixels)
    if mode == "phash":
        return perceptual_identity(image)
    raise ValueError(f"unknown mm_hash {mode!r}; choose one of {', '.join(MM_HASH_MODES)}")
