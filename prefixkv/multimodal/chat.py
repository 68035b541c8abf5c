"""Chat messages whose content has image parts -> messages for the chat template, and the images.

OpenAI's parts are read: {"type": "text", "text": ...}, {"type": "image_url", "image_url": {"url": ...}}
(or the url as a string), and vLLM's offline {"type": "image_pil", "image_pil": PIL image}. The template
sees HF's multimodal form - [{"type": "image"}, {"type": "text", "text": ...}] - which LLaVA templates
render as an image token; for a template that only takes string contents, each message becomes its
image tokens (one line each) followed by its text."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from PIL import Image

from .inputs import load_image
from .media import load_image_url

IMAGE_PART_TYPES = ("image_url", "image_pil")


def has_image_parts(messages: list[dict[str, Any]]) -> bool:
    """Whether any content part is not text (images; other kinds are refused by split_image_parts)."""
    return any(
        isinstance(m, dict)
        and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type", "text") != "text" for p in m["content"])
        for m in messages
    )


def _check_part_types(messages: list[dict[str, Any]]) -> int:
    """Refuse unknown part types; returns the number of image parts."""
    count = 0
    for i, m in enumerate(messages):
        content = m.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type", "text") if isinstance(part, dict) else None
            if kind is not None and kind != "text" and kind not in IMAGE_PART_TYPES:
                raise ValueError(
                    f"messages[{i}].content[{j}]: content part type {kind!r} is not supported (text, image_url)"
                )
            count += kind in IMAGE_PART_TYPES
    return count


def split_image_parts(
    messages: list[dict[str, Any]], allowed_local_media_path: str | None
) -> tuple[list[dict[str, Any]], list[Image.Image]]:
    """Messages with image parts as {"type": "image"} (in order) and the decoded images."""
    out: list[dict[str, Any]] = []
    images: list[Image.Image] = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            if not isinstance(part, dict):
                raise ValueError(f"{where} must be a dictionary with a type, got {type(part).__name__}")
            kind = part.get("type", "text")
            if kind == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise ValueError(f"{where}.text must be a string, got {type(text).__name__}")
                parts.append({"type": "text", "text": text})
            elif kind == "image_url":
                ref = part.get("image_url")
                url = ref.get("url") if isinstance(ref, dict) else ref
                images.append(load_image_url(url, allowed_local_media_path, f"{where}.image_url"))
                parts.append({"type": "image"})
            elif kind == "image_pil":
                images.append(load_image(part.get("image_pil"), f"{where}.image_pil"))
                parts.append({"type": "image"})
            else:
                raise ValueError(f"{where}: content part type {kind!r} is not supported (text, image_url)")
        out.append({**m, "content": parts})
    return out, images


def render_with_images(
    messages: list[dict[str, Any]],
    render: Callable[[list[dict[str, Any]]], str],
    image_token: str,
    num_images: int,
) -> str:
    """The template's text with one image token per image: list contents first; if the template
    does not render them (a string-only template), string contents with the image tokens in front."""
    try:
        text = render(messages)
        if text.count(image_token) == num_images and "{'type'" not in text:
            return text
    except Exception:  # noqa: BLE001 (a string-only template may fail on list contents: try strings)
        pass
    flat = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            n = sum(1 for p in content if p.get("type") == "image")
            texts = [p["text"] for p in content if p.get("type") == "text"]
            m = {**m, "content": (image_token + "\n") * n + "\n".join(texts)}
        flat.append(m)
    text = render(flat)
    if text.count(image_token) != num_images:
        raise ValueError(f"the chat template rendered {text.count(image_token)} image tokens for {num_images} images")
    return text


def chat_prompt_with_images(
    messages: list[dict[str, Any]],
    render: Callable[[list[dict[str, Any]]], str],
    image_token: str | None,
    allowed_local_media_path: str | None,
    max_images: int | None = None,
) -> tuple[str, list[Image.Image]]:
    """(the prompt text, its images) of one conversation with image parts. `image_token` None: the
    model is text-only, which is refused. The part count is checked against `max_images` before
    any image is decoded."""
    count = _check_part_types(messages)
    if image_token is None:
        raise ValueError("image inputs (image_url parts) were given but this model is text-only: it takes no images")
    if max_images is not None and count > max_images:
        raise ValueError(
            f"{count} images in one prompt; this engine takes at most {max_images} "
            "(limit_mm_per_prompt / --limit-mm-per-prompt)"
        )
    templated, images = split_image_parts(messages, allowed_local_media_path)
    return render_with_images(templated, render, image_token, len(images)), images
