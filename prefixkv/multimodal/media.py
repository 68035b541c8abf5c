"""Where an `image_url` may point: a data URL (base64), or - only when the engine was started with
`allowed_local_media_path` (vLLM's `--allowed-local-media-path`) - a file:// URL of a file under that
folder. Nothing is fetched from the network: http(s) URLs are refused with a message saying so."""

from __future__ import annotations

import base64
import binascii
import os
from urllib.parse import unquote, urlparse

from PIL import Image

from .inputs import load_image

MAX_DATA_URL_CHARS = 48 << 20  # far above any image a request body (32 MiB by default) can carry


def load_image_url(url: object, allowed_local_media_path: str | None, what: str = "image_url") -> Image.Image:
    """The decoded image an `image_url` names; ValueError (a 400 on the server) for anything else."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"{what}.url must be a non-empty string")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        raise ValueError(
            f"{what}: this server does not fetch from the network ({scheme} URLs are refused); "
            "send the image inline as a data URL (data:image/png;base64,...)"
        )
    if scheme == "data":
        return load_image(_data_url_bytes(url, what), what)
    if scheme == "file":
        return load_image(_local_file_bytes(url, allowed_local_media_path, what), what)
    raise ValueError(
        f"{what}: unsupported URL scheme {scheme or url[:16]!r}; use a data URL (data:image/png;base64,...)"
    )


def _data_url_bytes(url: str, what: str) -> bytes:
    if len(url) > MAX_DATA_URL_CHARS:
        raise ValueError(f"{what}: the data URL is longer than {MAX_DATA_URL_CHARS} characters")
    header, sep, payload = url[len("data:") :].partition(",")
    if not sep:
        raise ValueError(f"{what}: a data URL needs a comma before its data (data:image/png;base64,...)")
    media_type, *params = header.split(";")
    if media_type and not media_type.lower().startswith("image/"):
        raise ValueError(f"{what}: the data URL's media type is {media_type!r}, not an image")
    if "base64" not in [p.lower() for p in params]:
        raise ValueError(f"{what}: only base64 data URLs are supported (data:image/png;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{what}: the data URL is not valid base64") from None


def _local_file_bytes(url: str, allowed: str | None, what: str) -> bytes:
    if not allowed:
        raise ValueError(
            f"{what}: local files are not allowed; start the engine with allowed_local_media_path "
            "(--allowed-local-media-path) to serve files under a folder"
        )
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise ValueError(f"{what}: file URLs must name a local path (file:///...)")
    root = os.path.realpath(allowed)
    path = os.path.realpath(unquote(parsed.path))
    if os.path.commonpath([root, path]) != root:
        raise ValueError(f"{what}: {unquote(parsed.path)!r} is outside the allowed local media path")
    if not os.path.isfile(path):
        raise ValueError(f"{what}: no such file under the allowed local media path: {unquote(parsed.path)!r}")
    with open(path, "rb") as f:
        return f.read(MAX_DATA_URL_CHARS + 1)
